"""DistTGL's i x j x k parallel training as a controlled change of the single-process loop.

Every rank runs ``Trainer.prepare`` / ``Trainer.compute`` on the slice ``tgdist.distributed.schedule``
gives it. What changes, and why results stay comparable:
- gradients are summed over all ranks and divided by the number of ranks active in the iteration
  (idle ranks of the epoch-parallel tail contribute zeros), then every rank takes the same optimizer
  step, so all trainers stay replicas of one model;
- the learning rate is scaled with the global batch (``train.lr_scaling``, linear by default);
- negatives are a pure function of (seed, negative set, event index), so any rank drawing a set
  draws the same one;
- each memory group keeps one logical copy of node memory. Backend ``depcache`` (Sven's DepCache):
  every trainer of the group holds a replica; the writes of an iteration are all-gathered within the
  group and applied in group-rank order, after every read of that iteration (the write-after-read
  rule of mini-batch parallelism);
- epoch parallelism: subgroup jj trains position p at iteration p + jj but reads its memory at
  iteration p, before subgroup 0 writes p (DistTGL's j read slots); only subgroup 0 writes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import signal
import socket
import time
import traceback
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from tgdist import memory
from tgdist.config import model_tag
from tgdist.distributed import collectives
from tgdist.distributed.schedule import Layout, num_iterations, scaled_lr, step
from tgdist.errors import ConfigError
from tgdist.kernels.graph import cpu_mask
from tgdist.memory.store import MemoryRead
from tgdist.runtime import checkpoint, rundir
from tgdist.runtime.trainer import Trainer, memory_for

log = logging.getLogger(__name__)


def rank_logging(rank: int) -> None:
    """Prefix log lines with the rank; ranks other than 0 report warnings and errors only."""
    class _Prefix(logging.Filter):
        def filter(self, record):
            if not getattr(record, "tgdist_rank_prefixed", False):  # one record reaches every handler
                record.msg, record.tgdist_rank_prefixed = f"[rank {rank}] {record.msg}", True
            return True

    root = logging.getLogger()
    for h in root.handlers:
        h.addFilter(_Prefix())
    if rank:
        root.setLevel(logging.WARNING)


def memory_backend(cfg: DictConfig, layout: Layout) -> str:
    backend = cfg.memory.backend
    if backend == "auto":
        return "local" if layout.group_size == 1 else "depcache"
    if backend not in memory.names():
        raise ConfigError(f"memory.backend={backend}: parallel training supports {', '.join(memory.names())}")
    return backend


class ParallelRun:
    """One rank of an i x j x k run (``ProcessGroups`` already initialised)."""

    def __init__(self, trainer: Trainer, layout: Layout, rank: int, groups, epochs: int,
                 ckpt_dir: Path | None = None, ckpt_every: int = 0, cfg: DictConfig | None = None):
        self.tr, self.layout, self.rank, self.groups = trainer, layout, rank, groups
        self.ckpt_dir, self.ckpt_every, self.cfg = ckpt_dir, ckpt_every, cfg
        self.start_iteration = 0
        self.epochs = epochs
        self.counter = collectives.ByteCounter()
        self.n_train = trainer.split.range("train")[1]
        self.ii, self.jj, self.kk = layout.coords(rank)
        self.iterations = num_iterations(layout, self.n_train, trainer.batch_size, epochs)
        self.slots: dict[int, object] = {}
        trainer.grad_hook = self._average_gradients
        self.active = True
        self.losses: list[tuple[int, float, int]] = []  # (pass, loss * events, events) of this rank

    # ------------------------------------------------------------------------------------------

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.tr.model.parameters()]

    def _average_gradients(self) -> None:
        """Sum over all ranks, divide by the ranks active in this iteration (an idle rank adds zeros)."""
        params = list(self.tr.model.parameters())
        grads = self._grads() if self.active else [torch.zeros_like(p) for p in params]
        collectives.all_reduce_mean(grads, self.groups.get("world"), name="gradients", counter=self.counter,
                                    active=self.active)
        for p, g in zip(params, grads):
            p.grad = g

    def _idle_step(self) -> None:
        """An inactive rank still joins the gradient exchange and applies the same update."""
        self.active = False
        self.tr.optimizer.zero_grad(set_to_none=True)
        self._average_gradients()
        self.tr.optimizer.step()
        self.active = True

    def _negatives(self, s) -> np.ndarray:
        return self.tr.negatives.keyed(3 + s.neg_set, s.lo, s.hi, 1)

    def train(self, progress: bool, on_iteration=None) -> dict:
        """All iterations of this rank; ``on_iteration(t, loss or None)`` after each (tests)."""
        tr, lay = self.tr, self.layout
        tr.model.train()
        mem = tr.memory
        start = time.perf_counter()
        trained = 0
        fault = _fault_injection(self.rank)
        for t in range(self.start_iteration, self.iterations):
            if fault == t:  # tests: a real SIGKILL of this rank at a chosen iteration
                os.kill(os.getpid(), signal.SIGKILL)
            # read-ahead: the position this subgroup trains at iteration t + jj is read now, before
            # subgroup 0 writes it at the end of this iteration
            ahead = step(lay, self.rank, t + self.jj, self.n_train, tr.batch_size, self.epochs) \
                if t + self.jj < self.iterations else None
            if ahead is not None and ahead.active:
                mem.open_position(ahead.position, ahead.read_slot, ahead.reset_memory)
                self.slots[ahead.read_slot] = tr.prepare(ahead.lo, ahead.hi, self._negatives(ahead))
                if self.jj:  # this position's read is done; subgroup 0 writes it below
                    mem.close_position()
            now = step(lay, self.rank, t, self.n_train, tr.batch_size, self.epochs)
            loss = None
            if now.active and now.hi > now.lo:
                out = tr.compute(self.slots.pop(now.read_slot), train=True, write=now.writes)
                loss = out.loss
                self.losses.append((now.pass_index, out.loss * now.num_events, now.num_events))
                trained += now.num_events
            else:
                self.slots.pop(now.read_slot, None)
                self._idle_step()
            if self.jj == 0 and ahead is not None and ahead.active:
                mem.close_position()  # subgroup 0 has written the position it read
            mem.exchange()  # the group's writes of this iteration, everywhere (depcache's all-gather)
            if on_iteration is not None:
                on_iteration(t, loss)
            due = self.ckpt_every and (t + 1) % self.ckpt_every == 0 and t + 1 < self.iterations
            if due and self.ckpt_dir is not None:
                self.save(t + 1)
            if progress and (t % 50 == 0 or t == self.iterations - 1):
                el = time.perf_counter() - start
                log.info("iteration %d/%d, %d events on this rank, %.0f events/s", t + 1, self.iterations,
                         trained, trained / max(el, 1e-9))
        el = time.perf_counter() - start
        if self.ckpt_dir is not None and self.start_iteration < self.iterations:
            self.save(self.iterations)  # the trained model and memory, as a single-process run leaves them
        return {"iterations": self.iterations, "rank_events": trained, "rank_seconds": el,
                "rank_events_per_s": trained / max(el, 1e-9)}

    # ------------------------------------------------------------------------------------------
    # Checkpoints: one directory per iteration with every memory copy (saved by each group's
    # writer ii = jj = 0) and every rank's read slots and RNG; rank 0 then commits ``last.pt``
    # (model, optimizer, iteration) and removes older iteration directories.

    def save(self, iteration: int) -> None:
        tr, d = self.tr, self.ckpt_dir / f"it{iteration:08d}"
        slots = {slot: {"lo": p.lo, "hi": p.hi, "neg": torch.from_numpy(p.neg), "read": vars(p.read)}
                 for slot, p in self.slots.items()}
        checkpoint.atomic_save({"torch_rng": torch.get_rng_state(), "slots": slots, "losses": self.losses},
                               d / f"rank-{self.rank}.pt")
        if self.ii == 0 and self.jj == 0:
            checkpoint.atomic_save(tr.memory.state_dict(), d / f"memory-{self.kk}.pt")
        collectives.barrier(self.groups.get("world"), name="checkpoint")
        if self.rank == 0:
            checkpoint.atomic_save({"format": 1, "config": checkpoint.identity(self.cfg),
                                    "data": checkpoint.data_identity(tr.g), "iteration": iteration,
                                    "epochs": self.epochs, "dir": d.name, "model": tr.model.state_dict(),
                                    "optimizer": tr.optimizer.state_dict()}, self.ckpt_dir / "last.pt")
            for old in self.ckpt_dir.glob("it*"):
                if old.name != d.name:
                    shutil.rmtree(old, ignore_errors=True)
        collectives.barrier(self.groups.get("world"), name="checkpoint")

    def load(self, path: Path) -> None:
        tr = self.tr
        state = checkpoint.read(path, parallel=True)
        checkpoint.check_config(path, state["config"], self.cfg, content_checked="data" in state)
        checkpoint.check_data(path, state, tr.g)
        checkpoint.check_epochs(path, state, self.epochs)
        d = path.parent / state["dir"]
        tr.model.load_state_dict(state["model"])
        tr.optimizer.load_state_dict(state["optimizer"])
        shared = tr.memory.one_copy_per_group  # (a daemon's): its writer loads it
        if not shared or (self.ii == 0 and self.jj == 0):
            tr.memory.load_state_dict(checkpoint.read_part(d / f"memory-{self.kk}.pt"))
        if shared:
            collectives.barrier(self.groups.get("memory"), name="checkpoint")
        mine = checkpoint.read_part(d / f"rank-{self.rank}.pt")
        torch.set_rng_state(mine["torch_rng"])
        self.losses = [tuple(x) for x in mine["losses"]]
        self.slots = {int(slot): tr.prepare(v["lo"], v["hi"], v["neg"].numpy(),  # reads on the compute device
                                            read=MemoryRead(**{k: t.to(tr.device) for k, t in v["read"].items()}))
                      for slot, v in mine["slots"].items()}
        self.start_iteration = int(state["iteration"])
        log.info("resumed from %s at iteration %d", path, self.start_iteration)


def _fault_injection(rank: int) -> int | None:
    """``TGDIST_FAULT_KILL=RANK:ITERATION`` (tests only): that rank SIGKILLs itself there."""
    spec = os.environ.get("TGDIST_FAULT_KILL")
    if not spec:
        return None
    r, it = (int(x) for x in spec.split(":"))
    return it if r == rank else None


def model_digest(model: torch.nn.Module) -> str:
    """A hash of every parameter's bytes: the same on every rank while the replicas are one model."""
    h = hashlib.blake2b(digest_size=16)
    for p in model.parameters():
        h.update(p.detach().cpu().numpy().tobytes())
    return h.hexdigest()


def cpu_share(group) -> int:
    """CPU threads for this trainer: its affinity mask divided among the processes of this machine
    in ``group`` that have the same mask. Ranks that share the machine unbound (torchrun) split it;
    ranks bound to their own CPUs (SLURM's ``--cpus-per-task``, MPI binding) keep theirs."""
    mask = cpu_mask()
    mine = (socket.gethostname(), mask)
    peers = collectives.all_gather_object(mine, group, name="cpu_share", counter=collectives.ByteCounter())
    sharing = peers.count(mine)
    me = collectives.group_rank(group)
    if sharing > len(mask) and peers.index(mine) == me:  # said by the machine's first rank
        log.warning("%d trainer processes share %d CPU%s on %s: each runs one thread, and they take turns on "
                    "the cores (fewer processes, or more CPUs per process, would train faster on CPU)",
                    sharing, len(mask), "s" * (len(mask) != 1), mine[0])
    return max(1, len(mask) // sharing)


# Settings each rank may have its own of: where its machine keeps the data, threads, device, output.
_PER_RANK = {"data.path", "data.name", "data.cache", "data.cache_dir", "data.require_path", "train.num_threads",
             "sampler.num_threads", "train.device", "train.progress", "memory.num_threads"}


def shared_settings(cfg: DictConfig) -> dict:
    """The settings every rank of a parallel run must share (as strings): all of the config but
    ``_PER_RANK``. Ranks started by hand on several machines can be given other overrides."""
    return checkpoint.settings(cfg, ("data", "sampler", "model", "train", "parallel", "memory"), _PER_RANK)


def run_parallel(cfg: DictConfig, run_dir) -> dict:
    """Train with ``cfg.parallel`` under torchrun / SLURM / MPI; returns the summary (rank 0's).
    Every rank writes into rank 0's ``run_dir``, told once the ranks meet (a default name holds
    the time, which each rank would read off its own clock); the others may pass None."""
    from tgdist.distributed.world import ProcessGroups, detect, disagreement, validate
    from tgdist.runtime.build import build_trainer
    from tgdist.runtime.run import Run, jsonable, pretrain_static

    world = detect()
    rank_logging(world.rank)
    layout = Layout(cfg.parallel.i, cfg.parallel.j, cfg.parallel.k)
    backend = memory_backend(cfg, layout)
    validate(layout, world, backend, epochs=cfg.train.epochs)
    groups = ProcessGroups.init(world, layout, agree=shared_settings(cfg))
    trainer = par = None
    try:
        run_dir = Path(collectives.broadcast_object(str(run_dir) if world.rank == 0 else None, group=groups.get("world"),
                                                    name="run_dir"))
        if world.rank == 0:
            rundir.claim(run_dir, cfg.train.overwrite)  # (tgdist train claimed it already; Python callers)
        lr = scaled_lr(cfg.train.lr, layout.i, layout.j, layout.k, cfg.train.lr_scaling)
        run_cfg = OmegaConf.merge(cfg, {"train": {"lr": lr}})
        trainer = build_trainer(run_cfg, progress=False, cpus=cpu_share(groups.get("world")))
        g = trainer.g  # the same settings, but each machine reads its own copy of the data
        read = {"events": g.num_events, "nodes": g.num_nodes, "first and last time": (float(g.t[0]), float(g.t[-1])),
                "edge features": g.edge_dim, "node features": g.node_dim}
        if (why := disagreement(collectives.all_gather_object(read, group=groups.get("world"), name="data_check"),
                                "data")) is not None:
            raise ConfigError(why)
        validate(layout, world, backend, num_train_events=trainer.split.range("train")[1],
                 batch_size=cfg.train.batch_size, epochs=cfg.train.epochs)
        if cfg.model.static_memory and cfg.model.static_pretrain_epochs > 0 and not cfg.train.resume:
            # DistTGL 3.1 pre-training is cheap: rank 0 runs it, and every replica starts from its result
            if world.rank == 0:
                pretrain_static(trainer, cfg.model.static_pretrain_epochs)
            m = trainer.model
            collectives.broadcast_tensors([*m.static.parameters(), *m.predictor.parameters()],
                                          group=groups.get("world"), name="static_pretrain")
        par = ParallelRun(trainer, layout, world.rank, groups, cfg.train.epochs, ckpt_dir=Path(run_dir) / "checkpoints",
                          ckpt_every=cfg.train.checkpoint_every, cfg=cfg)
        m = trainer.model
        trainer.memory = memory.create(backend, memory.StoreContext(
            trainer.g.num_nodes, m.mem_dim, m.mail_dim, m.mailbox_size, device=trainer.device, layout=layout,
            rank=world.rank, groups=groups, counter=par.counter, cfg=cfg, batch_size=trainer.batch_size,
            fanouts=tuple(trainer.sampler.fanouts) if trainer.sampler is not None else (), graph=trainer.g,
            train_end=par.n_train))
        if cfg.train.resume:  # every rank reads the same files (one machine or a shared file system)
            par.load(checkpoint.find(cfg.train.resume))
        res = par.train(progress=world.rank == 0 and cfg.train.progress)
        stats = collectives.all_gather_object({**res, "losses": par.losses, "model": model_digest(trainer.model)},
                                              groups.get("world"))
        replicas_identical = len({s["model"] for s in stats}) == 1
        if not replicas_identical and world.rank == 0:
            log.warning("the trainers' model replicas differ after training (%d distinct parameter digests "
                        "over %d ranks); rank 0's model is evaluated", len({s["model"] for s in stats}), len(stats))
        trainer.memory.end_training(evaluates=world.rank == 0)  # rank 0 evaluates alone on group 0's memory

        def evaluate() -> dict:  # rank 0: memory group 0 ends its last pass at the end of the stream
            trainer.grad_hook = None
            metrics = {**trainer.evaluate("val"), **trainer.evaluate("test")}
            if cfg.train.task in ("node", "edge"):
                metrics.update(_downstream_alone(trainer, cfg))
            loss_sum = sum(l for s in stats for _, l, _ in s["losses"])
            events = sum(e for s in stats for _, _, e in s["losses"])
            summary = jsonable({"run_dir": str(run_dir), "data": cfg.data.name,
                       "model": model_tag(cfg.model.name, cfg.model.num_layers), "parallel": str(layout),
                       "memory_backend": backend, "epochs": cfg.train.epochs,
                       "batch_size": cfg.train.batch_size, "lr": lr, "iterations": par.iterations,
                       "loss": loss_sum / max(events, 1), "traversed_events": events, **metrics,
                       "train_events_per_s": rate(sum(s["rank_events"] for s in stats),
                                                  max(s["rank_seconds"] for s in stats)),
                       "replicas_identical": replicas_identical, "communication": par.counter.as_dict()})
            Run.write_summary(run_dir, run_cfg, summary)  # undefined metrics (an empty part) as null
            # one metrics line, as a single-process run writes per epoch: a parallel run evaluates once, at its end
            line = {"epoch": cfg.train.epochs - 1, "loss": summary["loss"], "train_events": events,
                    "events_per_s": summary["train_events_per_s"], **metrics}
            (Path(run_dir) / "metrics.jsonl").write_text(json.dumps(jsonable(line)) + "\n")
            return summary

        # the other ranks wait for rank 0's evaluation however long it takes (not the groups' timeout)
        summary = collectives.result_of(evaluate, groups.get("world"), name="summary")
        # every rank is done before any tears its process group down: a rank that leaves while a
        # peer still talks to it can abort in gloo's shutdown ("terminate called without an
        # active exception"). Only on this success path, so failures still exit at once.
        collectives.barrier(groups.get("world"), name="shutdown")
        return summary
    except BaseException as e:
        # the frames below this one hold the trainer, whose memory holds a process group: clear
        # their variables (the traceback's lines stay), so destroy() below can free every group
        traceback.clear_frames(e.__traceback__.tb_next)
        raise
    finally:
        if trainer is not None:
            trainer.memory.close()  # a daemon's client detaches, and stops the daemon it started
        trainer = par = None  # they hold group handles; destroy() frees the groups only with the last one
        groups.destroy()


def rate(events: int, seconds: float) -> float | None:
    """Events per second of the events trained by this process (a resumed run's earlier events
    are not in ``seconds``); None when it trained none (a finished run resumed)."""
    return events / max(seconds, 1e-9) if events else None


def _downstream_alone(trainer: Trainer, cfg: DictConfig) -> dict:
    """The node / edge task's decoder, on this rank alone: its replay of the stream from empty
    memory runs on a memory of its own, not on the group's shared copy."""
    from tgdist.runtime.run import downstream

    shared, trainer.memory = trainer.memory, memory_for(trainer.model, trainer.g.num_nodes).to(trainer.device)
    try:
        return downstream(trainer, cfg.train.task, cfg.train.node_class_epochs)
    finally:  # no reference to the shared copy (it holds a process group) outlives this call
        trainer.memory = shared
