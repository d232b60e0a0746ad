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

Evaluation: a run of one process validates after every ``train.eval_every``-th epoch and after
the last (AP and ROC-AUC against one negative; MRR too with ``train.val_mrr``), keeps the best
validated epoch's model and memory (``checkpoints/best.pt``), may stop early
(``train.patience``), and tests once at its end, completely, from the epoch ``train.select``
names (``_select_and_test``). A parallel run evaluates once, at its end, on rank 0 with memory
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
from tgdist.config.overrides import resume_note
from tgdist.distributed import collectives
from tgdist.distributed.schedule import num_global_batches, num_iterations, step
from tgdist.distributed.world import ProcessGroups, detect, disagreement
from tgdist.distributed.world import validate as validate_layout
from tgdist.errors import ConfigError
from tgdist.kernels import jit
from tgdist.kernels.interrupts import PREEMPT_SIGNAL, preemption_armed, preemption_requested
from tgdist.runtime import checkpoint, pipelines, reshard, rundir
from tgdist.runtime.build import Resolved, build_trainer, validate
from tgdist.runtime.cache import cache_totals
from tgdist.runtime.distributed import cpu_share, fault_injection, model_digest, rank_logging, shared_settings
from tgdist.runtime.tasks import downstream_alone, pretrain_static
from tgdist.runtime.tensorboard import TensorBoardLog
from tgdist.runtime.trainer import Progress, StageTimer, Trainer, memory_for

log = logging.getLogger(__name__)


def jsonable(d: dict) -> dict:
    """Plain floats, and None for a metric that is undefined (NaN is not JSON)."""
    return {k: (float(v) if np.isfinite(v) else None) if isinstance(v, (np.floating, float)) else v
            for k, v in d.items()}


class Run:
    """One rank's part of a training run in ``run_dir`` (rank 0's; ranks but 0 may pass None):
    ``train()`` once. Started in one process it trains alone; under torchrun / SLURM / MPI each
    rank makes its own ``Run`` and they meet in ``__init__``. ``trainer``: one built by the caller
    (its own graph or device, say); with local memory its store is used as it is, else the store
    the config names replaces it (a trainer built here is constructed with that store). ``groups``:
    process groups the caller initialised for this layout (and destroys; tests), else the run's own.
    ``choices``: what ``build.validate(cfg)`` returned, when the caller validated ``cfg``; else the
    run validates it, once, and builds its trainer from what that resolved."""

    def __init__(self, cfg: DictConfig, run_dir: str | Path | None, trainer: Trainer | None = None,
                 groups: ProcessGroups | None = None, choices: Resolved | None = None):
        # the one check of the settings (``choices``: the caller's, who validated this config), named
        # before the layout is refused; the trainer is built from what it resolved
        self.choices = choices or validate(cfg)
        self.cfg = cfg
        self.world = detect() if groups is None else groups.world
        self.layout = self.choices.layout
        self.backend = self.choices.backend
        self.alone = self.world.world_size == 1
        self.store = self.choices.store  # what the store can do (its capabilities)
        validate_layout(self.layout, self.world, self.backend, placement=self.store.placement,
                        epochs=cfg.train.epochs if cfg.train.epochs or not self.alone else None)
        if not self.alone:
            rank_logging(self.world.rank)
        self.rank = self.world.rank
        self.ii, self.jj, self.kk = self.layout.coords(self.rank)
        self._trained = False
        self._failing = False  # train() is failing: close() does not wait for other ranks' checkpoint parts
        # checkpoints written in the background (``save``): the writer, the host buffers it writes
        # from, the host copy of the iteration being saved, the iteration whose writes are under
        # way, and the iteration directory last.pt names
        self._writer, self._staging = checkpoint.Writer(), checkpoint.Staging()
        self._host: tuple | None = None
        self._writing: int | None = None
        self._committed: str | None = None
        self._resumed_from: str | None = None  # the iteration directory of the checkpoint this run resumed from
        self.save_seconds: list[float] = []  # the time each save held the training loop (benchmarks)
        self.trainer: Trainer | None = None
        self.pipeline: pipelines.Pipeline | None = None
        self._own_groups = groups is None
        if self._own_groups and self.alone:
            ProcessGroups.release_single()  # an earlier Run of this process never trained (or closed)
        self.groups = groups or ProcessGroups.init(self.world, self.layout, backend=cfg.parallel.comm_backend,
                                                   agree=None if self.alone else shared_settings(cfg),
                                                   device=cfg.train.device)
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
        self.lr = self.choices.lr  # train.lr scaled with the global batch (train.lr_scaling)
        self.run_cfg = cfg if self.lr == cfg.train.lr else OmegaConf.merge(cfg, {"train": {"lr": self.lr}})
        self.counter = collectives.ByteCounter()
        self._resume = None  # (path, state) of train.resume, checked here and loaded by train()
        if trainer is None:  # first: a config or data error leaves no directory
            trainer = build_trainer(self.run_cfg, progress=None if self.alone else False,
                                    cpus=None if self.alone else cpu_share(world_group), choices=self.choices,
                                    store=self._store)  # built with the store the config names
        else:  # the caller's trainer: checked as one built here is; with local memory its store is used as it is
            self._check_data(trainer.g, trainer.split)
            if not self.store.trainers_own:
                trainer.memory = self._store(trainer.g, trainer.split, trainer.model,
                                             tuple(trainer.sampler.fanouts) if trainer.sampler is not None else (),
                                             trainer.device)
        self.trainer = tr = trainer
        if cfg.train.save_scores and self.rank == 0:  # train.eval=tgb: the scores TGB's Evaluator can check
            tr.scores_dir = self.dir / "scores"
        self.iterations = num_iterations(lay, self.n_train, tr.batch_size, cfg.train.epochs) if cfg.train.epochs else 0
        self.batches_per_epoch = num_global_batches(self.n_train, lay.i, tr.batch_size)
        self.pipeline = pipelines.create(pipelines.PipelineContext(
            cfg, tr, lay, self.rank, self.alone, self.iterations, self.batches_per_epoch, self.groups, self.counter,
            self._step, self._negatives))  # (after the store: a pipeline's hooks hold it)
        self._reserve_staging()
        self.ckpt_dir = self.dir / "checkpoints"
        self.ckpt_path = self.ckpt_dir / "last.pt"
        self.best_path = self.ckpt_dir / "best.pt"  # the best validated epoch (one process)
        self.start_iteration = 0
        self.history: list[dict] = []
        self._tensorboard: TensorBoardLog | None = None  # train.tensorboard: made with the first line
        self.losses: list[tuple[int, float, int]] = []  # (pass, loss * events, events) of this rank
        self._passes: dict[int, list] = {}  # pass -> [loss * events, events] summed over self.losses
        if self.rank == 0:
            # (tgdist train checked this before Hydra wrote into the folder; Python callers)
            rundir.check_replace(self.dir, cfg.train.overwrite, cfg.train.resume)
            rundir.claim(self.dir, cfg.train.overwrite)
            if cfg.train.overwrite and (gone := rundir.clear_old_run(self.dir, cfg.train.resume)):
                log.info("train.overwrite=true: removed the earlier run's %s from %s", ", ".join(gone), self.dir)
            if (note := resume_note(cfg)) is not None:
                log.info("%s", note)
            self._write_config()

    def _check_data(self, graph, split) -> None:
        """What needs the data, checked before the store is made: every rank read the same data, the
        layout has the training events it needs, and a resume's checkpoint fits them."""
        cfg, lay = self.cfg, self.layout
        if not self.alone:
            g = graph  # the same settings, but each machine reads its own copy of the data
            read = {"events": g.num_events, "nodes": g.num_nodes, "first and last time": (float(g.t[0]), float(g.t[-1])),
                    "edge features": g.edge_dim, "node features": g.node_dim}
            if (why := disagreement(collectives.all_gather_object(read, group=self.groups.get("world"),
                                                                  name="data_check"), "data")) is not None:
                raise ConfigError(why)
        self.n_train = split.range("train")[1]
        validate_layout(lay, self.world, self.backend, placement=self.store.placement, num_train_events=self.n_train,
                        batch_size=cfg.train.batch_size,
                        epochs=cfg.train.epochs if cfg.train.epochs or not self.alone else None)
        if cfg.train.resume:  # a refused resume leaves the run directory (maybe the checkpoint's own) as it was
            self._resume = checkpoint.check_resume(cfg, self.backend)
            checkpoint.check_data(*self._resume, graph)
            reshard.plan(*self._resume, lay, self.rank, self.n_train, cfg.train.batch_size)  # its refusals, before any write

    def _store(self, graph, split, model, fanouts: tuple, device) -> memory.MemoryStore:
        """The trainer's memory store (``build_trainer``'s ``store``), after the checks that need the
        data (``_check_data``): its own local memory, or the store the config names, for this rank."""
        self._check_data(graph, split)
        if self.store.trainers_own:
            return memory_for(model, graph.num_nodes).to(device)
        return memory.create(self.backend, memory.StoreContext(
            graph.num_nodes, model.mem_dim, model.mail_dim, model.mailbox_size, device=device, layout=self.layout,
            rank=self.rank, groups=self.groups, counter=self.counter, cfg=self.cfg,
            batch_size=self.cfg.train.batch_size, fanouts=fanouts, graph=graph, train_end=self.n_train))

    def _write_config(self) -> None:
        """``config.yaml``: the run's settings as given, which ``train.resume`` composes again (the
        learning rate a parallel run trains at, scaled with its global batch, is a comment above
        them). Written whole or not at all: the ranks of a resumed run read it while rank 0 writes."""
        text = OmegaConf.to_yaml(self.cfg, resolve=True)
        if self.lr != self.cfg.train.lr:
            text = (f"# trained at lr {self.lr:g}: train.lr scaled with the global batch of {self.layout.i} x "
                    f"{self.layout.j} x {self.layout.k} trainers (train.lr_scaling={getattr(self.cfg.train.lr_scaling, 'name', self.cfg.train.lr_scaling)})\n"
                    + text)
        tmp = self.dir / f".config.yaml.{os.getpid()}.tmp"
        tmp.write_text(text)
        os.replace(tmp, self.dir / "config.yaml")

    def close(self) -> None:
        """Release the store (a daemon's client detaches and stops the daemon it started) and the
        process groups, after the checkpoint writes under way are done (those of a failing run
        stop waiting for other ranks' parts). ``train()`` closes; a ``Run`` never trained should be
        closed by its maker."""
        try:
            self._writer.close(abandon=self._failing)
        finally:
            self._host = self._writing = None
            self._staging.release()
        if self.pipeline is not None:
            self.pipeline.close()
        if self.trainer is not None and not self.store.trainers_own:  # a store made here (a caller's is the caller's)
            self.trainer.memory.close()
        if not self.alone and self._own_groups:
            self.trainer = None  # it holds group handles; destroy() frees the groups only with the last one
            self.pipeline = None  # (and so does the pipeline: the trainer, the gradient exchange's group)
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
            self._failing = True
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
                            "to continue); testing its selected epoch again",
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
        trained = seconds = 0
        try:
            if self.alone and self._stops_early() and self.start_iteration % self.batches_per_epoch == 0:
                log.info("the checkpoint's run stopped early (train.patience=%d): nothing left to train",
                         cfg.train.patience)
            else:
                trained, seconds = self._iterate(on_iteration)
        except _Stop as stop:
            log.info("stopping after %d training iterations (train.stop_after_batches)", stop.done)
            self._wait_writes()
            return {"stopped": True, "checkpoint": str(self.ckpt_path) if self.ckpt_path.exists() else None}
        except Preempted as stop:
            log.info("%s after iteration %d of %d: checkpointed in %s", stop.words(), stop.iteration,
                     self.iterations, self.ckpt_path)
            raise
        except _EarlyStop as stop:
            log.info("stopping after epoch %d: %d validations without a higher val AP (train.patience)",
                     stop.epoch, cfg.train.patience)
        if self.alone:
            return self._finish_alone()
        return self._finish_parallel(trained, seconds)

    def _iterate(self, on_iteration) -> tuple[int, float]:
        """The iterations from ``start_iteration`` on; returns the events this rank trained and the
        seconds it took. Each iteration is the schedule's step and the pipeline's hooks around it:
        read ahead, take the batch, compute (with the pipeline's step hooks), the memory store's
        exchange, and what the pipeline measures after the iteration."""
        cfg, tr, pipe = self.cfg, self.trainer, self.pipeline
        mem, nb = tr.memory, self.batches_per_epoch
        tr.model.train()
        every, stop_after = cfg.train.checkpoint_every, cfg.train.stop_after_batches
        fault = fault_injection(self.rank)
        preemptible = preemption_armed()
        start = time.perf_counter()
        trained = done = 0
        saved = self.start_iteration  # the iteration of the latest checkpoint
        epoch = None  # a run of one process: the epoch under way and its clock
        pipe.begin(self.start_iteration)
        for t in range(self.start_iteration, self.iterations):
            if self.alone and epoch is None:
                epoch = self._begin_epoch(t // nb)
            if fault == t:  # tests: a real SIGKILL of this rank at a chosen iteration
                os.kill(os.getpid(), signal.SIGKILL)
            began = time.perf_counter()
            pipe.read_ahead(t)
            now = self._step(t)
            batch = pipe.take(t, now)
            loss = None
            if now.active and now.hi > now.lo:
                out = tr.compute(batch, train=True, write=now.writes, hooks=pipe.hooks(t))
                loss = out.loss_t  # on the device: read at progress lines and epoch ends (issue 53.5)
                self._add_loss(now.pass_index, out.loss_t * now.num_events, now.num_events)
                trained += now.num_events
            else:  # an idle rank still joins the gradient exchange and applies the same update
                tr.optimizer.zero_grad(set_to_none=True)
                mem.start_exchange()  # where the active trainers start it: before the gradients
                if pipe.grads(tr.model.parameters(), active=False):
                    tr.optimizer.step()
            if t == self.iterations - 1 and pipe.grads.drain(tr.model.parameters()):
                tr.optimizer.step()  # asynchronous all-reduce: the last gradient, still in flight, is applied too
            pipe.after_step(t)
            mem.exchange()  # the group's writes of this iteration, everywhere (depcache's all-gather)
            pipe.after_exchange(t)
            pipe.after_iteration(t, time.perf_counter() - began)
            if on_iteration is not None:
                on_iteration(t, None if loss is None else float(loss))
            done += 1
            if epoch is not None:
                epoch.progress.update(now.num_events, loss=lambda i=epoch.index: self._epoch_loss(i)[0])
                epoch.ran += now.num_events
            if epoch is not None and (t + 1) % nb == 0:
                pipe.drain()
                pipe.end_epoch()
                self._end_epoch(epoch, t + 1)  # evaluates and saves
                epoch = None
                saved = t + 1
            elif every and (t + 1) % every == 0 and t + 1 < self.iterations:
                pipe.drain()
                self.save(t + 1, wait=False)
                saved = t + 1
            if preemptible and t + 1 < self.iterations and (signum := self._preemption_agreed()):
                pipe.drain()
                if saved != t + 1:
                    self.save(t + 1)
                else:
                    self._wait_writes()  # this iteration's checkpoint, written in the background: committed first
                if self.rank == 0:  # its next start here resumes, even one by hand (rundir.restarted)
                    rundir.mark_requeue(self.dir, t + 1)
                if not self.alone:  # no rank exits (and has its launcher stop the others) before the marker
                    collectives.barrier(self.groups.get("world"), name="preemption")
                raise Preempted(signum, t + 1)
            if not self.alone and self.rank == 0 and cfg.train.progress and (t % 50 == 0 or t == self.iterations - 1):
                el = time.perf_counter() - start
                log.info("iteration %d/%d, %d events on this rank, %.0f events/s", t + 1, self.iterations, trained,
                         trained / max(el, 1e-9))
            if stop_after is not None and done >= stop_after and t + 1 < self.iterations:
                pipe.drain()
                raise _Stop(done)
        pipe.drain()
        return trained, time.perf_counter() - start

    def _preemption_agreed(self) -> int:
        """The preemption signal when any rank has received it (0 when none has): every rank asks
        at the same iteration boundary, so they all stop after the same iteration. One all-reduce of
        one number per iteration in a parallel run, through the host (``collectives.host_group``:
        under NCCL a gloo twin of the world), so no device is waited for; none alone."""
        signum = preemption_requested() or 0
        if self.alone:
            return signum
        group = collectives.host_group(self.groups.get("world"))
        flag = torch.tensor([float(signum)], device=collectives.comm_device(group))
        collectives.all_reduce_mean([flag], group, name="preemption", counter=collectives.ByteCounter())
        return int(PREEMPT_SIGNAL) if float(flag) > 0 else 0

    def _step(self, t: int):
        return step(self.layout, self.rank, t, self.n_train, self.trainer.batch_size, self.cfg.train.epochs)

    def _negatives(self, s) -> np.ndarray:
        return self.trainer.negatives.keyed(3 + s.neg_set, s.lo, s.hi, 1)

    # ------------------------------------------------------------------------------------------
    # Epochs of a run of one process

    def _begin_epoch(self, index: int) -> "_Epoch":
        tr = self.trainer
        tr.model.train()  # evaluation left it in eval mode
        tr.timer = StageTimer()
        events = self._epoch_loss(index)[1]  # trained before a resume, mid-epoch
        prog = Progress(self.n_train - tr.split.range("train")[0], f"epoch {index} train", tr.progress)
        prog.done = events
        return _Epoch(index, prog, time.perf_counter(), jit.compile_seconds(), time.process_time())

    def _add_loss(self, pass_index: int, loss_sum, events: int) -> None:
        """``loss_sum``: a float, or a float64 scalar on the device (a trained batch's, read later:
        ``_settle_losses``, ``_epoch_loss``)."""
        self.losses.append((pass_index, loss_sum, events))
        acc = self._passes.setdefault(pass_index, [0.0, 0])
        acc[0] += loss_sum
        acc[1] += events

    def _epoch_loss(self, index: int) -> tuple[float, int]:
        """The mean training loss of pass ``index`` so far, and its events."""
        total, events = self._passes.get(index, (0.0, 0))
        return float(total) / max(events, 1), events

    def _settle_losses(self) -> list[tuple[int, float, int]]:
        """``self.losses`` with the device scalars read, all in one read, as floats."""
        held = [l for _, l, _ in self.losses if isinstance(l, torch.Tensor)]
        if held:
            values = iter(torch.stack(held).tolist())
            self.losses = [(g, next(values) if isinstance(l, torch.Tensor) else l, e) for g, l, e in self.losses]
        return self.losses

    def _end_epoch(self, epoch: "_Epoch", next_iteration: int) -> None:
        cfg, tr = self.cfg, self.trainer
        el, compiled = time.perf_counter() - epoch.start, jit.compile_seconds() - epoch.compiled
        cpu = time.process_time() - epoch.cpu  # all this process's threads; over train_seconds: cores kept busy
        loss, events = self._epoch_loss(epoch.index)
        self._settle_losses()  # the epoch's device scalars, read once
        if not np.isfinite(loss):
            log.warning("epoch %d: the training loss is %s: training diverged (lower train.lr?)", epoch.index, loss)
        res = {"epoch": epoch.index, "loss": loss, "train_events": events, "train_seconds": el,
               "compile_seconds": compiled, "events_per_s": epoch.ran / max(el - compiled, 1e-9),
               "train_cpu_seconds": cpu}
        train_stages = StageTimer(dict(tr.timer.seconds))  # before evaluation adds to it
        if tr.cache is not None:  # hits, expansions avoided, admissions and evictions of the epoch
            res["cache"] = tr.cache.take_stats()
        t = cfg.train
        last = epoch.index == t.epochs - 1
        validates = last or (epoch.index + 1) % t.eval_every == 0
        after_val = None  # the memory after validation, when testing moves it on
        if validates:
            self._check_settled(f"epoch {epoch.index}'s validation")
            start, num_neg = time.perf_counter(), None if t.val_mrr else 1
            res.update(tr.evaluate("val", num_neg))
            if t.test_every_epoch:  # the checkpoints keep the memory after validation, where the final test starts
                after_val = {k: v.clone() for k, v in tr.memory.state_dict().items()}
                res.update(tr.evaluate("test", num_neg))
            res["eval_seconds"] = time.perf_counter() - start
            self._check_settled(f"the end of epoch {epoch.index}'s evaluation")
        res["stage_seconds"] = {k: round(v, 4) for k, v in train_stages.seconds.items()}
        self._record(res)
        compiled = (f" (leaving out {res['compile_seconds']:.1f} s of one-time kernel compiling)"
                    if res["compile_seconds"] >= 0.5 else "")
        shown = [f"{k} {v:.4f}" for k, v in res.items() if k.startswith(("val_", "test_")) and v is not None]
        log.info("epoch %d: loss %.4f, %s train events/s%s", epoch.index, res["loss"],
                 ", ".join([*shown, f"{res['events_per_s']:,.0f}"]), compiled)
        log.info("training stage times:\n%s", train_stages.table(res["train_events"]))
        if validates and self._best() is self.history[-1]:
            self._save_best(epoch.index, next_iteration, after_val)
        self.save(next_iteration, memory_state=after_val, wait=False)
        if after_val is not None:
            tr.memory.load_state_dict(after_val)
        if validates and not last and self._stops_early():
            raise _EarlyStop(epoch.index)

    # Model selection (one process): the metrics lines say which epochs were validated, which was
    # best and how long ago, so a resumed run continues them exactly.

    def _check_settled(self, where: str) -> None:
        """Evaluation reads memory as training does, each batch after every earlier write: a
        store holding writes not yet exchanged here would give metrics from lagging memory."""
        if n := self.trainer.memory.pending_writes():
            raise RuntimeError(f"{n} memory write batches not yet exchanged at {where}: the memory store "
                               f"({type(self.trainer.memory).__name__}) would be read without them")

    @property
    def _selects_on(self) -> str:
        """The validation metric that picks the best epoch: val AP, or under TGB's protocol its val MRR."""
        return "val_mrr" if self.cfg.train.eval == "tgb" else "val_ap"

    def _validated(self) -> list[dict]:
        return [h for h in self.history if h["epoch"] >= 0 and self._selects_on in h]

    def _best(self) -> dict | None:
        """The line of the best validated epoch: the highest val AP (val MRR with train.eval=tgb),
        the earliest of equals (a tie is no gain); None without one (an empty val part, or NaN scores)."""
        key = self._selects_on
        scored = [h for h in self._validated() if h[key] is not None]
        return max(scored, key=lambda h: h[key]) if scored else None

    def _stops_early(self) -> bool:
        """``train.patience`` validations have passed since the best one (or since the start)."""
        validated, best = self._validated(), self._best()
        since = len(validated) - 1 - validated.index(best) if best is not None else len(validated)
        return 0 < self.cfg.train.patience <= since

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
        self._wait_writes()  # last.pt and best.pt are read below
        if cfg.train.epochs == 0 and not cfg.train.resume:  # the node and edge tasks too: their link baseline
            self.evaluate_untrained()
        if not self.ckpt_path.exists():  # nothing trained here (epochs=0): still the model
            self.save(self.iterations)
        self._select_and_test()
        self._check_settled("the end of the run")
        summary = self.summary()
        if cfg.train.task in ("node", "edge"):
            summary.update(downstream_alone(tr, cfg.train.task, cfg.train.node_class_epochs))
        (self.dir / "summary.json").write_text(json.dumps(summary, indent=1))
        return summary

    def _select_and_test(self) -> None:
        """The final test, complete (``train.num_neg_eval`` negatives), of the epoch
        ``train.select`` names: from the trainer's state when it is the last trained epoch (its
        model, and its memory after validation, as ``last.pt`` holds them), else from
        ``best.pt``, which holds the best epoch's the same way. So it gives what a run stopped at
        that epoch reports. Its line in ``metrics.jsonl`` gains the test metrics and
        ``selected``; the trainer is left with that epoch's model (the embeddings of the node and
        edge tasks come from it) and the memory at the end of the stream."""
        tr, trained = self.trainer, [h for h in self.history if h["epoch"] >= 0]
        if not trained:
            return
        for h in self.history:  # a resumed run's lines: its end is decided again
            h.pop("selected", None)
        if "eval_seconds" not in trained[-1]:  # a finished run of a tgdist before selection: it tested its
            trained[-1]["selected"] = True    # last epoch then, and its checkpoint's memory is after that test
            log.info("the checkpoint's run tested its last epoch (a tgdist before train.select): reporting that")
            return
        chosen = self._best() if self.cfg.train.select == "best_val" else None
        chosen = chosen or trained[-1]
        if chosen is not trained[-1]:
            state = checkpoint.read(self.best_path, map_location="cpu") if self.best_path.exists() else {}
            if state.get("epoch") != chosen["epoch"]:
                raise ConfigError(f"{self.best_path}: {'holds epoch ' + str(state.get('epoch')) if state else 'missing'}, "
                                  f"but the run's best validated epoch is {chosen['epoch']}; resume from a checkpoint "
                                  f"written with it, or use train.select=last")
            checkpoint.restore(self.best_path, tr.model, state["model"], "model")
            part = self.best_path.parent / state["dir"] / state["parts"][0]
            checkpoint.restore(part, tr.memory, checkpoint.read_part(part), "node memory")
        log.info("testing epoch %d (train.select=%s) with %s per event", chosen["epoch"], self.cfg.train.select,
                 "the data set's negatives" if tr.shipped is not None else f"{tr.num_neg_eval} negatives")
        start = time.perf_counter()
        chosen.update(jsonable(tr.evaluate("test")))
        chosen["final_test_seconds"] = time.perf_counter() - start
        chosen["selected"] = True
        with open(self.dir / "metrics.jsonl", "w") as mf:
            mf.writelines(json.dumps(h) + "\n" for h in self.history)
        if self._tensorboard is not None:  # the final test, at the selected epoch's step
            self._tensorboard.write({k: v for k, v in chosen.items() if k == "epoch" or k.startswith("test_")})
        log.info("epoch %d: %s", chosen["epoch"],
                 ", ".join(f"{k} {v:.4f}" for k, v in chosen.items() if k.startswith("test_") and v is not None))

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
        self._wait_writes()  # rank 0: last.pt committed, naming every rank's parts
        stats = collectives.all_gather_object({"events": trained, "seconds": seconds, "losses": self._settle_losses(),
                                               "model": model_digest(tr.model),
                                               "cache": tr.cache.take_stats() if tr.cache is not None else None},
                                              world_group)
        replicas_identical = len({s["model"] for s in stats}) == 1
        if not replicas_identical and self.rank == 0:
            log.warning("the trainers' model replicas differ after training (%d distinct parameter digests "
                        "over %d ranks); rank 0's model is evaluated", len({s["model"] for s in stats}), len(stats))
        tr.memory.end_training(evaluates=self.rank == 0)  # rank 0 evaluates alone on group 0's memory
        trained_any = any(s["events"] for s in stats)

        def evaluate() -> dict:  # rank 0: memory group 0 ends its last pass at the end of the stream
            start = time.perf_counter()
            self._check_settled("the evaluation after training")
            tr.progress = cfg.train.progress  # its progress lines, as one process's evaluation prints them
            metrics = {**tr.evaluate("val"), **tr.evaluate("test")}
            self._check_settled("the end of the run")
            # its one evaluation is complete; train.select has the last epoch to choose from
            metrics.update(eval_seconds=time.perf_counter() - start, selected=True)
            loss_sum = sum(l for s in stats for _, l, _ in s["losses"])
            events = sum(e for s in stats for _, _, e in s["losses"])
            rate = (sum(s["events"] for s in stats) / max(max(s["seconds"] for s in stats), 1e-9)
                    if trained_any else None)  # None: nothing trained here (a finished run resumed)
            # one metrics line, as a run of one process writes per epoch: a parallel run evaluates once, at its end
            caches = [s["cache"] for s in stats if s["cache"] is not None]  # each trainer's own
            cache = {"cache": cache_totals(caches)} if caches else {}
            seconds = max(s["seconds"] for s in stats) if trained_any else None  # the slowest rank's training
            self._record({"epoch": cfg.train.epochs - 1, "loss": loss_sum / max(events, 1), "train_events": events,
                          "train_seconds": seconds, "events_per_s": rate, **metrics, **cache})
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
               "parallel": str(self.layout), "memory_backend": self.backend, "pipeline": self.pipeline.summary(), "epochs": 0,
               "batch_size": cfg.train.batch_size, "lr": self.lr, "iterations": self.iterations}
        if not self.history:
            return out
        # the headline: the selected epoch's complete test and its validation (train.select)
        chosen = next((h for h in self.history if h.get("selected")), self.history[-1])
        out.update({k: v for k, v in chosen.items() if k.startswith(("val_", "test_")) or k == "loss"})
        trained = [h for h in self.history if h["epoch"] >= 0]
        if not trained:  # train.epochs=0: an untrained baseline
            return out
        best = self._best() or {}  # no best epoch without a val AP (an empty val part, or NaN scores)
        rates = [h["events_per_s"] for h in trained if h["events_per_s"] is not None]
        out["epochs"] = len(trained) if self.alone else cfg.train.epochs
        out["select"] = str(cfg.train.select)
        out["selected_epoch"] = chosen["epoch"]
        out["best_epoch"] = best.get("epoch")
        out["best_val_ap"] = best.get("val_ap")
        out["test_ap_at_best_val"] = best.get("test_ap")  # tested: selected, or train.test_every_epoch
        out["stopped_early"] = self.alone and self._stops_early() and trained[-1]["epoch"] < cfg.train.epochs - 1
        out["checkpoint"] = str(self.best_path if self.alone and chosen is best else self.ckpt_path)
        out["train_events_per_s"] = float(np.mean(rates)) if rates else None
        out["train_seconds"] = float(sum(h.get("train_seconds", 0.0) or 0.0 for h in trained))
        if self.alone:  # the CPU time of this process's training loops (a parallel run's ranks are apart)
            out["train_cpu_seconds"] = float(sum(h.get("train_cpu_seconds", 0.0) or 0.0 for h in trained))
        out["eval_seconds"] = float(sum((h.get("eval_seconds") or 0.0) + (h.get("final_test_seconds") or 0.0)
                                        for h in trained))
        out["traversed_events"] = int(sum(h["train_events"] for h in trained))
        out.update(extra or {})
        out["communication"] = self.counter.as_dict()
        return out

    # ------------------------------------------------------------------------------------------
    # Checkpoints, one format for every layout: ``checkpoints/itNNNNNNNN/`` holds every rank's RNG,
    # read slots and losses (``rank-R.pt``) and the memory (``memory-*.pt``, as the store says:
    # a file per memory group, or per shard); rank 0 then commits ``last.pt`` (model, optimizer,
    # iteration, metrics lines, the list of those files) and removes older iteration directories.
    # The training loop only copies the state to host memory; the writer thread writes the files
    # (``checkpoint.Writer``), and rank 0's commits ``last.pt`` once every rank's parts exist.

    background_writes = True  # False: each save waits for its writes (benchmarks: the synchronous baseline)

    def save(self, iteration: int, memory_state: dict | None = None, wait: bool = True) -> None:
        """``memory_state``: the node memory to write instead of the store's (one process: the
        memory after validation, where testing every epoch moved it on). ``wait=False`` (the
        training loop's checkpoints): return once the state is copied to host memory, the files
        being written in the background (a later save, the run's end or ``close`` waits for them);
        else return with ``last.pt`` committed."""
        began = time.perf_counter()
        self._writes_done_before(iteration)
        self.pipeline.settle()
        tr, d = self.trainer, self.ckpt_dir / f"it{iteration:08d}"
        if d.name == self._resumed_from:  # a resume on another layout counts its iterations anew: the checkpoint
            d = d.with_name(f"{d.name}b")  # it came from stays whole (every rank judges alike: not by _committed)
        world_group = self.groups.get("world")
        losses = self._settle_losses()  # the device scalars read, once
        mine = checkpoint.host_copy({**checkpoint.trainer_state(tr), "losses": losses, **self.pipeline.state()},
                                    self._staging, ("rank",))
        pending = self.pipeline.grads.pending()  # asynchronous all-reduce: the averaged gradient not yet applied
        name, writes = tr.memory.checkpoint_part(self.ii, self.jj, self.kk)
        memory = self._host_state(iteration, memory_state, "memory")["memory"] if writes else None
        if self.rank == 0 and d.exists() and d.name != self._committed:
            shutil.rmtree(d)  # a crashed attempt's parts: gone before any rank writes (the gather below orders it)
        files = collectives.all_gather_object((f"rank-{self.rank}.pt", name if writes else None), world_group,
                                              name="checkpoint", counter=collectives.ByteCounter())  # not training's
        head = None
        if self.rank == 0:
            host = self._host_state(iteration, memory_state, "model", "optimizer")
            head = {"format": checkpoint.FORMAT, "config": checkpoint.identity(self.cfg),
                    "data": checkpoint.data_identity(tr.g), "layout": str(self.layout),
                    "iteration": iteration, "epochs": self.cfg.train.epochs, "dir": d.name,
                    "memory_backend": self.backend,
                    "placement": checkpoint.settings(self.cfg, ("partition",), set())
                    if self.store.partitioned else None,
                    "parts": [r for r, _ in files] + [m for _, m in files if m is not None],
                    "model": host["model"], "optimizer": host["optimizer"],
                    "pending_gradients": checkpoint.host_copy(pending, self._staging, ("pending",)),
                    "history": [dict(h) for h in self.history]}
        rank, pause = self.rank, checkpoint.pause_for_tests(iteration, self.rank)

        def write(abandoned) -> None:
            try:
                time.sleep(pause)
                checkpoint.atomic_save(mine, d / f"rank-{rank}.pt")
                if memory is not None:
                    time.sleep(pause)
                    checkpoint.atomic_save(memory, d / name)
            except BaseException as e:
                checkpoint.report_failure(d, rank, e)  # rank 0 then commits nothing
                raise
            if head is None:
                return
            time.sleep(pause)
            if not checkpoint.await_parts(d, head["parts"], abandoned):
                return  # the run failed meanwhile: last.pt keeps naming the previous checkpoint
            checkpoint.atomic_save(head, self.ckpt_path)
            self._committed = d.name
            for old in self.ckpt_dir.glob("it*"):
                if old.name != d.name:
                    shutil.rmtree(old, ignore_errors=True)

        self._writer.submit(write, checkpoint.ready_event())
        if wait or not self.background_writes:
            self._wait_writes()
        self.save_seconds.append(time.perf_counter() - began)

    def _save_best(self, epoch: int, iteration: int, memory_state: dict | None) -> None:
        """``best.pt`` (one process): the model and the node memory after validation of epoch
        ``epoch``, the best so far, with its parts in ``best-itNNNNNNNN/``; ``checkpoint.load``
        reads it as it reads ``last.pt``. It is not a point to resume from (no RNG or position).
        Written in the background, from the host copy the ``save`` at the same iteration uses."""
        began = time.perf_counter()
        self._writes_done_before(iteration)
        tr, d = self.trainer, self.ckpt_dir / f"best-it{iteration:08d}"
        name, _ = tr.memory.checkpoint_part(0, 0, 0)
        host = self._host_state(iteration, memory_state, "memory", "model", "optimizer")
        head = {"format": checkpoint.FORMAT, "kind": "best", "epoch": epoch,
                "config": checkpoint.identity(self.cfg), "data": checkpoint.data_identity(tr.g),
                "layout": str(self.layout), "iteration": iteration, "epochs": self.cfg.train.epochs,
                "dir": d.name, "parts": [name], "model": host["model"], "optimizer": host["optimizer"],
                "history": [dict(h) for h in self.history]}

        def write(abandoned) -> None:
            checkpoint.atomic_save(host["memory"], d / name)  # its one part before the file that names it
            checkpoint.atomic_save(head, self.best_path)
            for old in self.ckpt_dir.glob("best-it*"):
                if old.name != d.name:
                    shutil.rmtree(old, ignore_errors=True)

        self._writer.submit(write, checkpoint.ready_event())
        if not self.background_writes:
            self._wait_writes()
        self.save_seconds.append(time.perf_counter() - began)

    def _host_state(self, iteration: int, memory_state: dict | None, *parts: str) -> dict:
        """``parts`` of the model, optimizer and node memory (the store's, or ``memory_state``)
        copied to host memory, each once per iteration: ``best.pt`` and ``last.pt`` of one epoch's
        end share the copy. A store whose ``state_dict`` is a copy already is not copied again."""
        key = (iteration, id(memory_state))
        if self._host is None or self._host[0] != key:
            self._host = (key, {})
        tr, host = self.trainer, self._host[1]
        for part in parts:
            if part in host:
                continue
            if part == "memory":
                state = tr.memory.state_dict() if memory_state is None else memory_state
                fresh = memory_state is None and tr.memory.state_dict_copies
                host[part] = state if fresh else checkpoint.host_copy(state, self._staging, (part,))
            else:
                held = tr.model if part == "model" else tr.optimizer
                host[part] = checkpoint.host_copy(held.state_dict(), self._staging, (part,))
        return host

    def _reserve_staging(self) -> None:
        """The host buffers for the node memory this rank writes, allocated by the writer thread
        while training starts: the first save then only copies (a large memory's first allocation
        costs its page faults, seen 10-20x the copy). The first save waits for it (``_writing``)."""
        memory = self.trainer.memory
        if not memory.checkpoint_part(self.ii, self.jj, self.kk)[1] or memory.state_dict_copies:
            return
        state = memory.state_dict()  # the live buffers: only their shapes are read
        self._writer.submit(lambda _: self._staging.reserve(state, ("memory",)))
        self._writing = -1

    def _writes_done_before(self, iteration: int) -> None:
        """A save of another iteration first waits for the writes under way (their host copy is
        refilled next); one of the same iteration (``best.pt``, then ``last.pt``) queues behind them."""
        if self._writing is not None and self._writing != iteration:
            self._wait_writes()
        self._writing = iteration

    def _wait_writes(self) -> None:
        """Every checkpoint write submitted is done (rank 0: and committed); the first error one met
        is raised here, as it was raised in the writer."""
        try:
            self._writer.wait()
        finally:
            self._host = self._writing = None

    def load(self, path: Path, state: dict) -> None:
        """Restore every rank's part of the checkpoint ``path`` (``state``: its ``last.pt`` as
        ``check_resume`` read it). A checkpoint of another layout or store has its memory
        re-placed and its ranks' files mapped to this layout's (``tgdist.runtime.reshard``)."""
        tr = self.trainer
        d = path.parent / state["dir"]
        moved = reshard.plan(path, state, self.layout, self.rank, self.n_train, tr.batch_size)
        checkpoint.restore(path, tr.model, state["model"], "model")
        checkpoint.restore(path, tr.optimizer, state["optimizer"], "optimizer state")
        if moved is not None:
            reshard.carry_lr(moved, tr.optimizer, self.cfg, self.lr)
        name, writes = tr.memory.checkpoint_part(self.ii, self.jj, self.kk)
        replaced = reshard.replaces_memory(state, self.cfg, self.layout, self.backend)
        if name not in state["parts"] and not replaced:  # (an older checkpoint names no store)
            held = ", ".join(p for p in state["parts"] if p.startswith("memory")) or "none"
            raise ConfigError(f"{path}: its node memory is in {held}, and this run's memory.backend={self.backend} "
                              f"reads {name}; resume with the memory.backend the run was written with")
        shared = tr.memory.one_copy_per_group  # (a daemon's): its writer loads it
        if replaced and (not shared or writes):
            reshard.load_memory(path, state, tr.memory, self.kk)
        elif not shared or writes:
            checkpoint.restore(d / name, tr.memory, checkpoint.read_part(d / name), "node memory")
        if shared:
            collectives.barrier(self.groups.get("memory"), name="checkpoint")
        mine = checkpoint.read_part(d / f"rank-{self.rank}.pt") if moved is None else moved.mine
        checkpoint.restore_trainer_state(path, tr, mine)
        self.losses, self._passes = [], {}
        for g, loss_sum, events in mine["losses"]:
            self._add_loss(int(g), float(loss_sum), int(events))
        self.pipeline.load_state(mine)  # its read slots, read again from the saved rows
        self.pipeline.grads.restore(state.get("pending_gradients"), tr.device)
        self.history = [dict(h) for h in state["history"]]
        self.start_iteration = int(state["iteration"]) if moved is None else moved.start
        self._committed = state["dir"]  # (when resumed in its own directory: a save never clears it)
        self._resumed_from = state["dir"]
        best = path.parent / "best.pt"  # a run of one process resumed into another directory takes its best.pt
        if self.alone and best.exists() and best.parent.resolve() != self.ckpt_dir.resolve():
            parts = best.parent / checkpoint.read(best, map_location="cpu", mmap=True)["dir"]
            shutil.copytree(parts, self.ckpt_dir / parts.name, dirs_exist_ok=True)
            shutil.copy2(best, self.best_path)
        log.info("resumed from %s at iteration %d of %d", path, self.start_iteration, self.iterations)


class _Epoch:
    """The epoch under way in a run of one process: its index, progress line and clocks."""

    def __init__(self, index: int, progress: Progress, start: float, compiled: float, cpu: float):
        self.index, self.progress, self.start, self.compiled, self.cpu = index, progress, start, compiled, cpu
        self.ran = 0  # events trained in this process (a resumed epoch's earlier ones are not timed)


class _EarlyStop(Exception):
    """``train.patience`` validations without gain: the run ends after epoch ``epoch``."""

    def __init__(self, epoch: int):
        super().__init__(epoch)
        self.epoch = epoch


class Preempted(Exception):
    """The preemption signal (``tgdist.kernels.interrupts.stop_on_preemption``): every rank
    finished iteration ``iteration - 1`` and the run checkpointed there (``checkpoints/last.pt``).
    ``tgdist train`` exits with ``PREEMPTED_EXIT``, on which the sbatch templates requeue the job."""

    def __init__(self, signum: int, iteration: int):
        super().__init__(signum, iteration)
        self.signum, self.iteration = signum, iteration

    def words(self) -> str:
        return f"stopped by {signal.Signals(self.signum).name} (preemption)"


class _Stop(Exception):
    def __init__(self, done: int):
        super().__init__(done)
        self.done = done

