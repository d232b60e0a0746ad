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
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from tgdist import memory
from tgdist.config import model_tag
from tgdist.data.sampler import TCSR
from tgdist.distributed import collectives
from tgdist.distributed.schedule import Layout, num_global_batches, num_iterations, scaled_lr, step
from tgdist.distributed.world import ProcessGroups, detect, disagreement
from tgdist.distributed.world import validate as validate_layout
from tgdist.errors import ConfigError
from tgdist.kernels import jit
from tgdist.memory.store import MemoryRead
from tgdist.runtime import checkpoint, rundir
from tgdist.runtime.build import build_trainer, micro_batches, staleness, validate
from tgdist.runtime.cache import cache_totals
from tgdist.runtime.distributed import (cpu_share, fault_injection, memory_backend, model_digest, rank_logging,
                                        shared_settings)
from tgdist.runtime.mspipe import (STAGES, StageLocks, StageStreams, lower_priority, max_staleness, mitigate,
                                     quantile_gap, read_schedule, similar_nodes, stale_rows, staleness_bounds,
                                     update_gaps)
from tgdist.runtime.pipeline import GradientSync, Prefetcher, fit_eta, fit_granularity
from tgdist.runtime.tasks import downstream_alone, pretrain_static
from tgdist.runtime.tensorboard import TensorBoardLog
from tgdist.runtime.trainer import SIDE_STREAMS, Progress, StageTimer, Trainer, micro_bounds

log = logging.getLogger(__name__)
MSPIPE_THREADS = 8  # mspipe: stage threads, one per batch in flight (Algorithm 1); more batches queue in order


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
        self.prefetcher: Prefetcher | None = None
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
                                    cpus=None if self.alone else cpu_share(world_group),
                                    local_memory=self.backend == "local")  # another store replaces it below
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
        pipe = cfg.pipeline
        self.grads = GradientSync(world_group, self.counter, stale=pipe.async_allreduce)
        self.micro = micro_batches(pipe)  # None: auto, measured over the first iterations (``_choose_micro_batches``)
        self.fit = None  # the eq. (12) fit of micro_batches=auto
        self._profile_rows: list = []  # micro_batches=auto: per profiled batch, its read and eta data
        self._profile_steps: list = []  # ... and the seconds of each profiled iteration
        self._measuring = 0.0  # seconds of this iteration spent measuring, not training
        self.mspipe = pipe.mode == "mspipe"
        # mspipe's K (reads made K iterations ahead); None: auto, measured (``_choose_staleness``)
        self.staleness = staleness(pipe) if self.mspipe else 0
        self.bounds = None  # staleness=auto: what it measured and chose (the summary's ``pipeline``)
        self._online = None  # staleness=auto: K of each position in an epoch, the online schedule's k_i - 1
        self._stage_rows: list = []  # staleness=auto: per measured iteration, its stage seconds, reads, writes
        self._next_read = 0  # mspipe: the next batch (iteration) to read
        self._read_k: dict[int, int] = {}  # mspipe: the K each read in flight was issued with
        self._locks: StageLocks | None = None  # mspipe: the per-stage locks of Algorithm 1
        self._read_pool: ThreadPoolExecutor | None = None  # mspipe: the stages before training, a thread per batch
        self._write_pool: ThreadPoolExecutor | None = None  # mspipe: the memory update stage
        self._writes: list[Future] = []  # mspipe: memory updates handed to the update stage, not yet waited for
        self.stage_spans: list | None = None  # mspipe: a list to record each stage's turns in (timelines, tests)
        self._streams = StageStreams(tr.device if self.mspipe else "cpu")  # mspipe on a GPU: its CUDA streams
        self._sampler_calls = None  # the sampler's call count after the last batch consumed (prefetch)
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
        self.gamma = None  # MSPipe-S: seconds after which a read node's memory counts as stale
        self._stale_read = self._mitigated = 0  # MSPipe-S: stale rows read, and those it changed
        if self.mspipe and pipe.mitigation == "similarity":
            n = self.n_train
            self.gamma = quantile_gap(update_gaps(tr.g.src[:n], tr.g.dst[:n], tr.t_rel[:n]), pipe.mitigation_quantile)
            self._tcsr = tr.sampler.tcsr if tr.sampler is not None else TCSR.build(tr.g)
        self.ckpt_dir = self.dir / "checkpoints"
        self.ckpt_path = self.ckpt_dir / "last.pt"
        self.best_path = self.ckpt_dir / "best.pt"  # the best validated epoch (one process)
        self.start_iteration = 0
        self.history: list[dict] = []
        self._tensorboard: TensorBoardLog | None = None  # train.tensorboard: made with the first line
        self.losses: list[tuple[int, float, int]] = []  # (pass, loss * events, events) of this rank
        self._passes: dict[int, list] = {}  # pass -> [loss * events, events] summed over self.losses
        self.slots: dict[int, object] = {}  # read slot -> a prepared batch read ahead (epoch parallelism)
        if self.rank == 0:
            if not cfg.train.resume and (self.dir / "metrics.jsonl").exists():
                log.warning("run_dir %s already holds a run; its metrics, summary and checkpoint are replaced", self.dir)
                for old in (self.dir / "summary.json", self.ckpt_path, self.best_path):  # not taken for this run's
                    old.unlink(missing_ok=True)
            rundir.claim(self.dir, cfg.train.overwrite)
            (self.dir / "config.yaml").write_text(OmegaConf.to_yaml(self.run_cfg, resolve=True))

    def close(self) -> None:
        """Release the store (a daemon's client detaches and stops the daemon it started) and the
        process groups. ``train()`` closes; a ``Run`` never trained should be closed by its maker."""
        self._stop_prefetch()
        if getattr(self, "_locks", None) is not None:  # stages still waiting (after an error) give up
            self._locks.fail(RuntimeError("the run is closing"))
        for name in ("_read_pool", "_write_pool"):
            if getattr(self, name, None) is not None:
                getattr(self, name).shutdown(wait=True, cancel_futures=True)
                setattr(self, name, None)
        if self.trainer is not None and self.backend != "local":  # a store made here (a caller's is the caller's)
            self.trainer.memory.close()
        if not self.alone and self._own_groups:
            self.trainer = None  # it holds group handles; destroy() frees the groups only with the last one
            if getattr(self, "grads", None) is not None:
                self.grads.group = None  # (the gradient exchange's too)
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
            return {"stopped": True, "checkpoint": str(self.ckpt_path) if self.ckpt_path.exists() else None}
        except _EarlyStop as stop:
            log.info("stopping after epoch %d: %d validations without a higher val AP (train.patience)",
                     stop.epoch, cfg.train.patience)
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
        fault = fault_injection(self.rank)
        start = time.perf_counter()
        trained = done = 0
        epoch = None  # a run of one process: the epoch under way and its clock
        if self.mspipe:  # what a checkpoint restored is through its stages already
            self._locks = StageLocks(STAGES, done=self.start_iteration - 1)
            self._locks.spans = self.stage_spans
            self._locks.mark("memory_read", self._next_read - 1)  # the batches it read ahead
        for t in range(self.start_iteration, self.iterations):
            if self.alone and epoch is None:
                epoch = self._begin_epoch(t // nb)
            if fault == t:  # tests: a real SIGKILL of this rank at a chosen iteration
                os.kill(os.getpid(), signal.SIGKILL)
            began = time.perf_counter()
            stages = dict(tr.timer.seconds) if self.staleness is None else None  # staleness=auto measures
            if self.mspipe:  # MSPipe: the batches that may be read during this iteration go to the stage threads
                ahead = None
                self._read_ahead(t)
            else:
                # read-ahead: the position this subgroup trains at iteration t + jj is read now, before
                # subgroup 0 writes it at the end of this iteration
                ahead = self._step(t + self.jj) if t + self.jj < self.iterations else None
                if ahead is not None and ahead.active:
                    mem.open_position(ahead.position, ahead.read_slot, ahead.reset_memory)
                    self.slots[ahead.read_slot] = self._prepare(t, ahead, lookup=self.jj == 0)
                    if self.jj:  # this position's read is done; subgroup 0 writes it below
                        mem.close_position()
            now = self._step(t)
            key = now.position if self.mspipe else now.read_slot  # (mspipe reads by position, ``_read_ahead``)
            loss = row = None
            self.grads.issue()  # asynchronous all-reduce: the last iteration's, now that the reads are out
            if now.active and now.hi > now.lo:
                if not self.mspipe:  # (mspipe's later reads may wait for this iteration's update)
                    self._settle_reads()
                batch = self._take(key)
                if stages is not None:  # C3's data: the nodes this iteration reads and those it writes
                    row = {"reads": batch.ids.cpu().numpy(), "writes": np.unique(
                        np.concatenate([tr.g.src[now.lo:now.hi], tr.g.dst[now.lo:now.hi]]))}
                    self._stage_rows.append(row)
                wrote = []
                out = tr.compute(batch, train=True, write=now.writes, sync_gradients=self.grads,
                                 written=mem.start_exchange, before_write=self._settle_reads if not self.mspipe
                                 else lambda: self._before_write(t),
                                 defer_write=self._update_stage(t, wrote) if self.mspipe and self.alone else None)
                if self.mspipe and self.alone and not wrote:  # no write made: the update stage still passes t
                    self._update_stage(t, wrote)(lambda: None)
                loss = out.loss
                self._add_loss(now.pass_index, out.loss * now.num_events, now.num_events)
                trained += now.num_events
            else:  # an idle rank still joins the gradient exchange and applies the same update
                if not self.mspipe:
                    self._settle_reads()
                self._take(key)
                if self.mspipe and self.alone:
                    self._update_stage(t, [])(lambda: None)
                tr.optimizer.zero_grad(set_to_none=True)
                mem.start_exchange()  # where the active trainers start it: before the gradients
                if self.grads(tr.model.parameters(), active=False):
                    tr.optimizer.step()
            if t == self.iterations - 1 and self.grads.drain(tr.model.parameters()):
                tr.optimizer.step()  # asynchronous all-reduce: the last gradient, still in flight, is applied too
            if self.jj == 0 and ahead is not None and ahead.active:
                mem.close_position()  # subgroup 0 has written the position it read
            if self.mspipe and not self.alone:  # (a rank that does not write waits here for reads that must miss t)
                self._before_write(t)
            mem.exchange()  # the group's writes of this iteration, everywhere (depcache's all-gather)
            if self.mspipe and not self.alone:  # the update stage is here: the writes are in every replica now
                self._streams.settle()  # (on a GPU: done there too, before the reads that wait for them start)
                with self._locks.turn("memory_write", self._locks.ticket("memory_write"), t):
                    pass
            if self.micro is None:
                self._profile_steps.append(time.perf_counter() - began - self._measuring)
                self._measuring = 0.0
                if t + 1 - self.start_iteration == cfg.pipeline.profile_iterations:
                    self._choose_micro_batches()
            if stages is not None:
                if row is not None:
                    row["seconds"] = [tr.timer.seconds.get(k, 0.0) - stages.get(k, 0.0) for k in STAGES]
                if t + 1 - self.start_iteration == cfg.pipeline.profile_iterations or t + 1 == self.iterations:
                    self._choose_staleness()
            if on_iteration is not None:
                on_iteration(t, loss)
            done += 1
            if epoch is not None:
                epoch.progress.update(now.num_events, loss=self._epoch_loss(epoch.index)[0])
                epoch.ran += now.num_events
            if epoch is not None and (t + 1) % nb == 0:
                self._drain()
                self._stop_prefetch()  # (it had sampled to here) evaluation samples on this sampler too
                self._end_epoch(epoch, t + 1)  # evaluates and saves
                epoch = None
            elif every and (t + 1) % every == 0 and t + 1 < self.iterations:
                self._drain()
                self.save(t + 1)
            if not self.alone and self.rank == 0 and cfg.train.progress and (t % 50 == 0 or t == self.iterations - 1):
                el = time.perf_counter() - start
                log.info("iteration %d/%d, %d events on this rank, %.0f events/s", t + 1, self.iterations, trained,
                         trained / max(el, 1e-9))
            if stop_after is not None and done >= stop_after and t + 1 < self.iterations:
                self._drain()
                raise _Stop(done)
        self._drain()
        return trained, time.perf_counter() - start

    def _step(self, t: int):
        return step(self.layout, self.rank, t, self.n_train, self.trainer.batch_size, self.cfg.train.epochs)

    def _negatives(self, s) -> np.ndarray:
        return self.trainer.negatives.keyed(3 + s.neg_set, s.lo, s.hi, 1)

    # ------------------------------------------------------------------------------------------
    # Pipelining (``runtime.pipeline``)

    def _prepare(self, t: int, s, lookup: bool = False):
        """The batch of step ``s`` (read ahead at iteration ``t``) sampled, organized and read:
        one ``Prepared``, or one per micro-batch. Its sampling comes from the prefetch worker when
        there is one (from the end of auto's measured iterations on); the memory read is always
        made here, in order with the writes. ``lookup``: ``s`` trains at iteration ``t``, so the
        embedding cache is looked up and the subgraph pruned before the read (``Trainer.prepare``)."""
        tr, n, neg = self.trainer, self.micro or 1, self._negatives(s)
        if self.micro is None:  # auto: measuring, with one micro-batch, then two
            n = 1 if t - self.start_iteration < self.cfg.pipeline.profile_iterations // 2 else 2
        sampled = None
        if self.cfg.pipeline.prefetch and self.micro is not None:
            if self.prefetcher is None:
                self._start_prefetch(t)
            sampled, self._sampler_calls = self.prefetcher.get(t)
        if n > 1:
            return tr.prepare_micro(s.lo, s.hi, neg, n, sampled=sampled, lookup=lookup)
        read_before = tr.timer.seconds["memory_read"]
        p = tr.prepare(s.lo, s.hi, neg, sampled=sampled, lookup=lookup)
        if self.micro is None:
            self._measure_rows(s, neg, tr.timer.seconds["memory_read"] - read_before)
        return p

    def _pipeline(self) -> dict:
        """The pipelining this run used, for its summary (``micro_batches``: the n auto chose;
        ``staleness``: mspipe's K, the one auto chose)."""
        pipe = self.cfg.pipeline
        fit = None if self.fit is None else {k: round(float(v), 6) for k, v in vars(self.fit).items()}
        out = {"prefetch": pipe.prefetch, "micro_batches": self.micro, "async_allreduce": pipe.async_allreduce,
               "fit": fit, "mode": pipe.mode}
        if self.mspipe:
            out.update({"staleness": self.staleness, "bounds": self.bounds, "stage_nice": pipe.stage_nice})
        if self.gamma is not None:
            out["mitigation"] = {"gamma_s": self.gamma, "lambda": pipe.mitigation_lambda,
                                 "stale_rows_read": self._stale_read, "rows_mitigated": self._mitigated}
        return out

    # ------------------------------------------------------------------------------------------
    # MSPipe (``runtime.mspipe``)

    def _staleness_of(self, u: int) -> int:
        """K of iteration ``u``'s read: 0 while auto measures, then the online schedule's k_i - 1
        for its position in the epoch (``staleness_bounds``), or the fixed ``pipeline.staleness``."""
        if self.staleness is None:
            return 0
        if self._online is not None:
            return int(self._online[min(u % self.batches_per_epoch, len(self._online) - 1)])
        return self.staleness

    def _read_ahead(self, t: int) -> None:
        """mspipe, at the start of iteration t: hand to the stage threads (Algorithm 1: a thread
        per batch, ``StageLocks``) the positions u not handed yet whose read may happen during
        iteration t, those with u - K_u - 1 <= t, in order. Each thread samples, organizes and
        reads (``_front``); its read waits for the update of position u - K_u - 1 and the update
        of u - K_u waits for the read (``_before_write``), so position u misses exactly the writes
        of u - K_u .. u - 1. Subgroup 0 writes position p at iteration p, so a position is read
        on the same schedule by every subgroup; subgroup jj trains it jj iterations later (epoch
        parallelism: DistTGL's read slots, here a read per position in flight or done).
        Reads never cross an epoch: the next epoch starts from reset memory, after evaluation, so
        its first batches read it alike (the warm-up, MSPipe Appendix D.3). Nor a reset inside one
        (memory parallelism, k > 1: a group's stream wraps to its first batch mid-pass): the
        position that resets is read at its own iteration, after every write before it, so the
        positions after a reset miss only writes made since."""
        mem, nb, locks, jj = self.trainer.memory, self.batches_per_epoch, self._locks, self.jj
        end = min((t // nb + 1) * nb, self.iterations - (self.layout.j - 1))  # (positions of the group)
        self._next_read = max(self._next_read, t)
        while self._next_read < end and self._next_read - self._staleness_of(self._next_read) - 1 <= t:
            u = self._next_read
            s = self._step(u + jj)  # the step at which this rank trains position u
            if u > t and s.active and s.reset_memory:
                break
            if s.active:
                mem.open_position(s.position, s.read_slot, s.reset_memory)
                sampled, self._sampler_calls = self._sampled(u)  # (the prefetch thread's, when on)
                stages = ("memory_read",) if sampled is not None else ("sample", "features", "memory_read")
                tickets = {st: locks.ticket(st) for st in stages}
                k = self._read_k[u] = self._staleness_of(u)
                self.slots[u] = self._reader().submit(self._front, u, k, s, self._negatives(s), sampled, tickets,
                                                      self._streams.mark())  # (after the reset above, on a GPU)
                mem.close_position()
            self._next_read += 1

    def _front(self, u: int, k: int, s, neg, sampled, tickets: dict, after=None):
        """(a stage thread) MSPipe's stages 1-3 of iteration ``u``, each in its turn: sample,
        features (skipped when the prefetch thread made them), then the memory read once the update
        of u - k - 1 is done (Algorithm 1, line 9; at once in the epoch's first k + 1 iterations),
        mitigated with MSPipe-S when on. On a GPU they run on the fetch stream, after event
        ``after`` (what the main thread had enqueued when it handed the batch over), and the read's
        turn ends once that stream is done (``StageStreams``)."""
        tr, locks, streams = self.trainer, self._locks, self._streams
        try:
            with streams.on_stream("fetch", after):
                if sampled is None:
                    sampled = tr.sample(s.lo, s.hi, neg, turn=lambda stage: locks.turn(stage, tickets[stage], u))
                locks.wait("memory_write", u - k - 1)  # (before its turn: its span is the read alone)
                with locks.turn("memory_read", tickets["memory_read"], u):
                    p = self._mitigate(tr.prepare(s.lo, s.hi, neg, sampled=sampled))
                    streams.finish("fetch")
                    return p
        except BaseException as e:  # the later stages' threads are not left waiting for this one
            locks.fail(e)
            raise

    def _before_write(self, t: int) -> None:
        """mspipe, before the update of position t: wait until the reads that must miss it (u - K_u
        <= t; with epoch parallelism u = t too, trained later) are done. (Reads that must see it
        wait for it in their thread; those of positions trained already are out of ``_read_k``.)"""
        last = max((u for u, k in self._read_k.items() if u - k <= t), default=None)
        if last is not None:
            self._locks.wait("memory_read", last)

    def _update_stage(self, t: int, wrote: list):
        """mspipe: MSPipe's stage 5 for iteration t, as ``Trainer.compute``'s ``defer_write``: the
        write runs in the update thread in its turn (after t - 1's), overlapping t's backward pass
        and the next iteration; ``wrote`` records that it was handed over."""
        locks, tr, streams = self._locks, self.trainer, self._streams
        ticket = locks.ticket("memory_write")

        def update(write, after):  # (on a GPU: on the update stream, after the forward pass that made the rows)
            with locks.turn("memory_write", ticket, t):
                began = time.perf_counter()
                with streams.on_stream("update", after):
                    write()  # (it holds the rows until the stream is done with them: no hand-over needed)
                streams.finish("update")
                tr.timer.add("memory_write", time.perf_counter() - began)

        def hand(write):
            wrote.append(t)
            if self._write_pool is None:
                self._write_pool = ThreadPoolExecutor(1, thread_name_prefix="tgdist-mspipe-update",
                                                      initializer=lower_priority,  # pipeline.stage_nice
                                                      initargs=(self.cfg.pipeline.stage_nice,))
            self._writes.append(self._write_pool.submit(update, write, streams.mark()))

        return hand

    def _drain(self) -> None:
        """Wait for every MSPipe update handed over and every read in flight (before evaluation, a
        checkpoint, the end; nothing to wait for otherwise); an error in a stage is raised here."""
        writes, self._writes = self._writes, []
        for f in writes:
            f.result()
        self._settle_reads()

    def _mitigate(self, p):
        """MSPipe-S (3.3) on a training read (``pipeline.mitigation=similarity``): each node of the
        batch whose latest write (its latest mail's time) is older than gamma at the batch's first
        event gets lambda s_v + (1 - lambda) * the mean memory of its most similar active
        nodes of the batch (``mspipe.similar_nodes``, ``mspipe.mitigate``). The memory times stay."""
        if self.gamma is None:
            return p
        tr, r = self.trainer, p.read
        now = float(tr.t_rel[p.lo])
        updated = r.mail_ts.max(1).values  # a node's latest write is its latest mail's event
        rows = stale_rows(updated, now, self.gamma)
        if rows:
            similar = similar_nodes(self._tcsr, p.ids.cpu().numpy(), rows, tr.g.t[p.lo])
            mem = mitigate(r.mem, updated, now, similar, self.gamma, self.cfg.pipeline.mitigation_lambda)
            self._stale_read += len(rows)
            self._mitigated += int((mem != r.mem).any(1).sum())
            p.read = MemoryRead(mem, r.mem_ts, r.mail, r.mail_ts)
        return p

    def _sampled(self, u: int):
        """The prefetch worker's sampling of batch ``u`` and the sampler's count after it, or
        ``(None, None)`` without a worker (the read then samples too)."""
        if not self.cfg.pipeline.prefetch:
            return None, None
        if self.prefetcher is None:
            self._start_prefetch(u)
        return self.prefetcher.get(u)

    def _reader(self) -> ThreadPoolExecutor:
        if self._read_pool is None:  # Algorithm 1's thread per batch in flight (more queue, in order)
            self._read_pool = ThreadPoolExecutor(MSPIPE_THREADS, thread_name_prefix="tgdist-mspipe-stages",
                                                 initializer=lower_priority,  # pipeline.stage_nice
                                                 initargs=(self.cfg.pipeline.stage_nice,))
        return self._read_pool

    def _take(self, key: int):
        """The batch read for slot ``key`` (None if there is none), waited for if in flight."""
        p = self.slots.pop(key, None)
        if isinstance(p, Future):
            p = p.result()
        self._read_k.pop(key, None)
        return p if p is None or not self.mspipe else self._streams.hand_over(p)  # (made on the fetch stream)

    def _settle_reads(self) -> None:
        """Wait for the reads in flight (mspipe): before an iteration writes, and before a batch is used."""
        for u, p in self.slots.items():
            if isinstance(p, Future):
                self.slots[u] = p.result()
                self._read_k.pop(u, None)

    def _choose_staleness(self) -> None:
        """staleness=auto, after ``profile_iterations`` iterations read without staleness: the
        stage times tau (the median per stage of the measured iterations but the first, which
        compiles kernels), C3's cap from the nodes they read and wrote, and k_i over an epoch from
        C1-C2 (``mspipe.staleness_bounds``); the run then reads with each position's K_i (the
        online schedule, ``read_schedule``). A parallel run takes rank 0's choice on every rank."""
        rows = [r for r in self._stage_rows if "seconds" in r]
        self._stage_rows = []
        choice = (0, None, None)
        if rows:
            timed = rows[1:] or rows
            tau = np.median(np.array([r["seconds"] for r in timed]), axis=0)
            cap = max_staleness([r["reads"] for r in rows], [r["writes"] for r in rows],
                                self.cfg.pipeline.max_stale_fraction, upper=max(len(rows) - 1, 0))
            bounds = staleness_bounds(tau, self.batches_per_epoch, cap)
            choice = (bounds.steady(), read_schedule(bounds.staleness).tolist(),
                      {"tau": [round(float(x), 6) for x in tau], "stages": list(STAGES), "max_staleness": cap,
                       "steady_k": bounds.steady() + 1, "stall_s": round(float(bounds.stall.sum()), 6),
                       "schedule": "online", "k_per_position": _runs(bounds.k)})
        if not self.alone:
            choice = collectives.broadcast_object(choice, group=self.groups.get("world"), name="staleness",
                                                  counter=collectives.ByteCounter())
        self.staleness, online, self.bounds = choice
        self._online = None if online is None else np.asarray(online, dtype=np.int64)
        if self.bounds is None:
            log.info("pipeline.staleness=auto: nothing measured (empty batches?); using 0")
        elif self.rank == 0:
            b = self.bounds
            log.info("pipeline.staleness=auto: K=%d (the paper's k=%d) from stage times %s ms, C3's cap K<=%d "
                     "(at most %.0f%% of the nodes read stale)", self.staleness, self.staleness + 1,
                     ", ".join(f"{n} {1e3 * x:.2f}" for n, x in zip(STAGES, b["tau"])), b["max_staleness"],
                     100 * self.cfg.pipeline.max_stale_fraction)

    def _start_prefetch(self, t: int) -> None:
        """A worker sampling the batches this rank reads from iteration ``t`` on: to the end of the
        epoch in a run of one process (evaluation, which samples too, follows it), else to the end."""
        tr, n = self.trainer, self.micro or 1
        end = (t // self.batches_per_epoch + 1) * self.batches_per_epoch if self.alone else self.iterations

        def jobs():
            for u in range(t, end):
                s = self._step(u + self.jj) if u + self.jj < self.iterations else None
                if s is not None and s.active:
                    yield u, s

        def make(s):
            neg = self._negatives(s)
            sampled = tr.sample(s.lo, s.hi, neg) if n == 1 else tr.sample_micro(s.lo, s.hi, neg, n)
            return sampled, (tr.sampler.calls if tr.sampler is not None else 0)

        self.prefetcher = Prefetcher(make, jobs(), self.cfg.pipeline.prefetch)

    def _stop_prefetch(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()
            self.prefetcher = None
            if self._sampler_calls is not None and self.trainer.sampler is not None:
                self.trainer.sampler.calls = self._sampler_calls  # as if nothing were sampled ahead
            self._sampler_calls = None

    def _measure_rows(self, s, neg, read_s: float) -> None:
        """micro_batches=auto: eq. (22)'s data for this batch (rows to read per event in
        micro-batches of 1/1, 1/2, 1/4 and 1/8 of it; sampled on a side stream, so training's
        sampling is untouched) and the seconds its read took. The sampling here is not the
        iteration's: its time is left out of the iteration's (``_measuring``)."""
        tr = self.trainer
        began = time.perf_counter()
        b = s.hi - s.lo
        points = []
        with tr.side_stream(SIDE_STREAMS["replay"]):
            for parts in (1, 2, 4, 8):
                if b // parts < 1:
                    break
                rows = sum(int(tr.sample(a, c, neg[a - s.lo:c - s.lo]).ids.numel())
                           for a, c in micro_bounds(s.lo, s.hi, parts))
                points.append((b / parts, rows / b))
        self._profile_rows.append({"read_s": read_s, "eta": points, "events": b})
        self._measuring += time.perf_counter() - began

    def _choose_micro_batches(self) -> None:
        """micro_batches=auto, after the profiled iterations: eq. (12) fitted on rank 0 from what
        it measured (one micro-batch in the first half, two in the second), and its n used by every
        rank from here on."""
        cfg = self.cfg
        fit = None
        if self.rank == 0:
            half = cfg.pipeline.profile_iterations // 2
            steps = self._profile_steps
            one, two = steps[:half], steps[half:]
            reads = [r for r in self._profile_rows if r["events"]]
            sizes = [m for r in reads for m, _ in r["eta"]]
            eta = [e for r in reads for _, e in r["eta"]]
            if reads and len(set(sizes)) >= 2 and one and two:
                # the least of each: on a shared machine noise only ever adds time (the first compiles kernels)
                dispatch = float(np.min([r["read_s"] for r in reads]))
                total1, total2 = float(np.min(one)), float(np.min(two))
                compute = max(total1 - dispatch, 1e-6)
                bs = int(np.median([r["events"] for r in reads]))
                # what one more micro-batch surely costs: the latencies of its reads' collectives (slots,
                # counts and rows); its rows are not sent again (a batch's read is redundancy-free)
                link = collectives.current_link()
                floor = 3 * link.latency if link is not None else 0.0
                overhead = max(total2 - total1 + min(compute, dispatch) / 2, floor, 1e-4)
                fit = fit_granularity(sizes, eta, bs, compute, dispatch, overhead, cfg.pipeline.max_micro_batches)
        if not self.alone:
            fit = collectives.broadcast_object(fit, group=self.groups.get("world"), name="micro_batches",
                                               counter=collectives.ByteCounter())
        self.fit = fit
        self.micro = fit.n if fit is not None else 1
        if fit is None:
            log.info("pipeline.micro_batches=auto: too little measured (empty batches?); using 1")
        elif self.rank == 0:
            log.info("pipeline.micro_batches=auto: n=%d from eq. (12) n = (A bs + B) / S with A=%.3f, B=%.1f, S=%.1f "
                     "rows = %.0f rows/s x %.2f ms (measured per batch: compute %.1f ms, dispatch %.1f ms, %.2f ms per "
                     "extra micro-batch; cost-model optimum %.2f)", fit.n, fit.A, fit.B, fit.S, fit.rows_per_s,
                     1e3 * fit.tau_s, 1e3 * fit.compute_s, 1e3 * fit.dispatch_s, 1e3 * fit.overhead_s, fit.n_model)

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
        cpu = time.process_time() - epoch.cpu  # all this process's threads; over train_seconds: cores kept busy
        loss, events = self._epoch_loss(epoch.index)
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
        self.save(next_iteration, memory_state=after_val)
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

    def _validated(self) -> list[dict]:
        return [h for h in self.history if h["epoch"] >= 0 and "val_ap" in h]

    def _best(self) -> dict | None:
        """The line of the best validated epoch: the highest val AP, the earliest of equals (a
        tie is no gain); None without a val AP (an empty val part, or NaN scores)."""
        scored = [h for h in self._validated() if h["val_ap"] is not None]
        return max(scored, key=lambda h: h["val_ap"]) if scored else None

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
        log.info("testing epoch %d (train.select=%s) with %d negatives per event", chosen["epoch"],
                 self.cfg.train.select, tr.num_neg_eval)
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
        stats = collectives.all_gather_object({"events": trained, "seconds": seconds, "losses": self.losses,
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
            self._record({"epoch": cfg.train.epochs - 1, "loss": loss_sum / max(events, 1), "train_events": events,
                          "events_per_s": rate, **metrics, **cache})
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
               "parallel": str(self.layout), "memory_backend": self.backend, "pipeline": self._pipeline(), "epochs": 0,
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

    def save(self, iteration: int, memory_state: dict | None = None) -> None:
        """``memory_state``: the node memory to write instead of the store's (one process: the
        memory after validation, where testing every epoch moved it on)."""
        self._settle_reads()
        tr, d = self.trainer, self.ckpt_dir / f"it{iteration:08d}"
        world_group = self.groups.get("world")
        def saved(p):  # a read still in flight (micro-batches) is waited for
            return {"lo": p.lo, "hi": p.hi, "neg": torch.from_numpy(p.neg), "read": vars(collectives.resolve(p.read))}

        slots = {slot: [saved(q) for q in p] if isinstance(p, list) else saved(p) for slot, p in self.slots.items()}
        calls = self._sampler_calls if self._sampler_calls is not None else tr.sampler.calls if tr.sampler else 0
        checkpoint.atomic_save({"torch_rng": torch.get_rng_state(), "slots": slots, "losses": self.losses,
                                "sampler_calls": calls, "micro_batches": self.micro, "staleness": self.staleness,
                                "staleness_bounds": self.bounds},
                               d / f"rank-{self.rank}.pt")
        pending = self.grads.pending()  # asynchronous all-reduce: the averaged gradient not yet applied
        name, writes = tr.memory.checkpoint_part(self.ii, self.jj, self.kk)
        if writes:
            checkpoint.atomic_save(tr.memory.state_dict() if memory_state is None else memory_state, d / name)
        files = collectives.all_gather_object((f"rank-{self.rank}.pt", name if writes else None), world_group,
                                              name="checkpoint", counter=collectives.ByteCounter())  # not training's
        if self.rank == 0:
            checkpoint.atomic_save({"format": checkpoint.FORMAT, "config": checkpoint.identity(self.cfg),
                                    "data": checkpoint.data_identity(tr.g), "layout": str(self.layout),
                                    "iteration": iteration, "epochs": self.cfg.train.epochs, "dir": d.name,
                                    "parts": [r for r, _ in files] + [m for _, m in files if m is not None],
                                    "model": tr.model.state_dict(), "optimizer": tr.optimizer.state_dict(),
                                    "pending_gradients": pending,
                                    "history": [dict(h) for h in self.history]}, self.ckpt_path)
            for old in self.ckpt_dir.glob("it*"):
                if old.name != d.name:
                    shutil.rmtree(old, ignore_errors=True)
        collectives.barrier(world_group, name="checkpoint")

    def _save_best(self, epoch: int, iteration: int, memory_state: dict | None) -> None:
        """``best.pt`` (one process): the model and the node memory after validation of epoch
        ``epoch``, the best so far, with its parts in ``best-itNNNNNNNN/``; ``checkpoint.load``
        reads it as it reads ``last.pt``. It is not a point to resume from (no RNG or position)."""
        tr, d = self.trainer, self.ckpt_dir / f"best-it{iteration:08d}"
        name, _ = tr.memory.checkpoint_part(0, 0, 0)
        checkpoint.atomic_save(tr.memory.state_dict() if memory_state is None else memory_state, d / name)
        checkpoint.atomic_save({"format": checkpoint.FORMAT, "kind": "best", "epoch": epoch,
                                "config": checkpoint.identity(self.cfg), "data": checkpoint.data_identity(tr.g),
                                "layout": str(self.layout), "iteration": iteration, "epochs": self.cfg.train.epochs,
                                "dir": d.name, "parts": [name], "model": tr.model.state_dict(),
                                "optimizer": tr.optimizer.state_dict(),
                                "history": [dict(h) for h in self.history]}, self.best_path)
        for old in self.ckpt_dir.glob("best-it*"):
            if old.name != d.name:
                shutil.rmtree(old, ignore_errors=True)

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
            if self.mspipe and tr.model.num_hops:  # the slots below are sampled again, with the draws they had
                tr.sampler.calls -= len(mine["slots"])
        self.losses, self._passes = [], {}
        for g, loss_sum, events in mine["losses"]:
            self._add_loss(int(g), float(loss_sum), int(events))
        def restored(v):  # reads on the compute device
            return tr.prepare(v["lo"], v["hi"], v["neg"].numpy(),
                              read=MemoryRead(**{k: t.to(tr.device) for k, t in v["read"].items()}))

        self.slots = {int(slot): [restored(q) for q in v] if isinstance(v, list) else restored(v)
                      for slot, v in sorted(mine["slots"].items())}
        if self.mspipe:
            self._next_read = max(self.slots, default=-1) + 1
            if self.staleness is None and mine.get("staleness") is not None:
                self.staleness = int(mine["staleness"])  # auto chose it before the checkpoint
                self.bounds = b = mine.get("staleness_bounds")
                self._online = read_schedule(staleness_bounds(b["tau"], self.batches_per_epoch, b["max_staleness"])
                                             .staleness)
        if self.micro is None and mine.get("micro_batches") is not None:
            self.micro = int(mine["micro_batches"])  # auto chose it before the checkpoint: not measured again
        self.grads.restore(state.get("pending_gradients"), tr.device)
        self.history = [dict(h) for h in state["history"]]
        self.start_iteration = int(state["iteration"])
        best = path.parent / "best.pt"  # a run of one process resumed into another directory takes its best.pt
        if self.alone and best.exists() and best.parent.resolve() != self.ckpt_dir.resolve():
            parts = best.parent / checkpoint.read(best, map_location="cpu", mmap=True)["dir"]
            shutil.copytree(parts, self.ckpt_dir / parts.name, dirs_exist_ok=True)
            shutil.copy2(best, self.best_path)
        log.info("resumed from %s at iteration %d of %d", path, self.start_iteration, self.iterations)


def _runs(k: np.ndarray) -> list[list[int]]:
    """``[[k, count], ...]``: a per-position schedule told in runs (the summary's)."""
    out: list[list[int]] = []
    for v in np.asarray(k).tolist():
        if out and out[-1][0] == v:
            out[-1][1] += 1
        else:
            out.append([int(v), 1])
    return out


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


class _Stop(Exception):
    def __init__(self, done: int):
        super().__init__(done)
        self.done = done
