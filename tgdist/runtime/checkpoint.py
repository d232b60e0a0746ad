"""Checkpoints: model, optimizer, node memory and mails, RNG states and the position in the run,
in one format for every layout (``Run.save`` writes it: ``last.pt`` and an iteration directory of
parts beside it).

Saving does not stall training for the write: at an iteration boundary the state is copied to host
memory (``host_copy``, into buffers kept from one save to the next), and a ``Writer`` thread writes
the files while the next iterations train. A file is complete once it exists under its name
(``atomic_save``); ``last.pt`` is committed last, by rank 0, once every part it names exists, so a
crash during a background write leaves the previous ``last.pt`` in place, naming complete parts.

Every file is sealed with a SHA-256 of its bytes (``tgdist.checksum``) and checked against it
before ``torch.load(weights_only=True)`` parses it: a corrupt file is refused in one line. Files
without a checksum, written by tgdist before checksums, load as before. A checkpoint written under
a different config (data, model, sampler or training settings that change the results) is refused
with the keys that differ.
"""

from __future__ import annotations

import copy
import errno
import glob
import json
import logging
import os
import queue
import shutil
import tempfile
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Callable

import torch
from omegaconf import DictConfig, OmegaConf

from tgdist import checksum
from tgdist.config import SECTIONS
from tgdist.errors import ConfigError

log = logging.getLogger(__name__)

# 2: one format for every layout (``iteration``, ``parts``, ``history``). Format 1 had a
# single-process kind (``position``) and a parallel kind (without ``parts``).
FORMAT = 2

# Settings that do not change what is computed, so a resumed run may change them.
_FREE = {"train": {"epochs", "resume", "progress", "checkpoint_every", "stop_after_batches", "num_threads", "device",
                   "test_every_epoch", "overwrite", "select", "patience", "eval_every", "val_mrr", "tensorboard",
                   "eval", "save_scores"},
         "data": {"cache", "cache_dir", "name", "require_path", "root", "download"}, "sampler": {"num_threads"},
         "parallel": {"link"},  # the simulated link only delays collectives
         # prefetching changes nothing computed; micro-batches change only rounding
         "pipeline": {"prefetch", "micro_batches", "profile_iterations", "max_micro_batches"}}


# Keys added after checkpoints were first written, with the value an older checkpoint was
# written under (data.time_unit: times were read as seconds, which "auto" still does for all but
# Unix-epoch ms/us/ns data).
_ADDED = {"data.time_unit": repr("auto"), "pipeline.async_allreduce": repr(False)}


# Values renamed since checkpoints were first written: the old value reads as the new one.
_RENAMED = {"pipeline.mode": {repr("none"): repr("plain")}}  # the plain loop's strategy (runtime.pipelines)


def identity(cfg: DictConfig) -> dict:
    """The part of the config a checkpoint must match, as plain strings (weights_only-safe)."""
    return settings(cfg, ("data", "sampler", "model", "train", "parallel", "pipeline"),
                    {f"{g}.{k}" for g, keys in _FREE.items() for k in keys})


def settings(cfg: DictConfig, groups: tuple[str, ...], leave_out: set[str]) -> dict:
    """``{"group.key": repr(value)}`` for the keys of ``groups`` in ``cfg``, resolved, but those in
    ``leave_out``."""
    out = {}
    for group in groups:
        if group not in cfg:
            continue
        for key, value in OmegaConf.to_container(cfg[group], resolve=True, enum_to_str=True).items():
            if f"{group}.{key}" not in leave_out:
                out[f"{group}.{key}"] = repr(value)
    return out


def atomic_save(obj, path: str | Path) -> Path:
    """``torch.save`` to a temp file, sealed with its checksum and renamed into place: a crash
    never leaves a truncated file, and a corrupt one is refused when read. The temp file of a
    process killed while it wrote ``path`` (SIGKILL, out of memory: no handler runs) is removed
    here; every checkpoint file has one writer, so it is nobody else's."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
        stale.unlink(missing_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        torch.save(obj, tmp)
        checksum.seal(tmp)
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError) and e.filename == tmp:  # the seal's write: name the checkpoint, not its temp file
            raise OSError(e.errno, e.strerror, str(path)) from None
        if isinstance(e, RuntimeError) and ("PytorchStreamWriter" in str(e) or "inline_container" in str(e)):
            # torch's zip writer reports a failed write (a full disk, a quota) without its errno
            free = shutil.disk_usage(path.parent).free
            if free < 2**24:
                raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)}: {free / 2**20:.1f} MiB free",
                              str(path)) from None
            raise OSError(errno.EIO, f"the write failed; torch: {' '.join(str(e).split())[:120]}",
                          str(path)) from None
        raise
    return path


# Where the data was read from: checked through its content (``data_identity``) when the
# checkpoint records it, so the same file under another spelling or place resumes.
_DATA_PLACE = {"data.path", "data.name"}


# The layout: ``check_layout`` judges it (a resume may change parallel.i where j = k = 1).
_LAYOUT = {"parallel.i", "parallel.j", "parallel.k"}


def check_config(path, saved: dict, cfg: DictConfig, content_checked: bool = False,
                 layout_checked: bool = False) -> None:
    """One line naming every key that differs between the checkpoint's config and ``cfg``.
    ``content_checked``: the data's identity is compared by content, not by its path;
    ``layout_checked``: the layout was judged by ``check_layout``."""
    mine = identity(cfg)
    saved = {**_ADDED, **saved}
    if layout_checked:
        mine, saved = ({k: v for k, v in d.items() if k not in _LAYOUT} for d in (mine, saved))
    # a strategy section holds the keys its strategy reads (tgdist.config.SECTIONS): another
    # strategy's keys in a checkpoint (one written before, or the mode itself differs) are not compared
    saved = {k: v for k, v in saved.items() if k in mine or k.partition(".")[0] not in SECTIONS}
    for key, renamed in _RENAMED.items():
        for d in (mine, saved):
            if key in d:
                d[key] = renamed.get(d[key], d[key])
    diff = sorted(k for k in set(mine) | set(saved) if mine.get(k) != saved.get(k)
                  and not (content_checked and k in _DATA_PLACE))
    if diff:
        shown = ", ".join(f"{k}: checkpoint {saved.get(k, '<unset>')} vs now {mine.get(k, '<unset>')}" for k in diff)
        raise ConfigError(f"{path}: checkpoint was written under another config ({shown})")


def data_identity(graph) -> dict:
    """What a checkpoint records of its data: the source's content hash and the sizes."""
    return {"source_hash": str(graph.source_hash), "events": int(graph.num_events), "nodes": int(graph.num_nodes)}


def check_data(path, state: dict, graph) -> None:
    """One line when the checkpoint was trained on other data (the same path holding another
    file, say); checkpoints from before this check record no data and are not refused."""
    saved = state.get("data")
    if saved is None:
        return
    now = data_identity(graph)
    if saved != now:
        diff = ", ".join(f"{k} {saved.get(k)} vs now {now[k]}" for k in now if saved.get(k) != now[k])
        raise ConfigError(f"{path}: checkpoint was trained on other data ({diff}); resume with the data it was "
                          f"trained on")


def restore(path, module, state_dict: dict, what: str) -> None:
    """``module.load_state_dict`` with its shape mismatches as one line."""
    try:
        module.load_state_dict(state_dict)
    except (RuntimeError, ValueError, KeyError) as e:
        # torch lists one problem per tab-indented line: the first in full, and how many more
        problems = [" ".join(ln.split()).rstrip(".") for ln in str(e).splitlines()[1:] if ln.strip()]
        first = problems[0] if problems else " ".join(str(e).split())
        more = f"; and {len(problems) - 1} more" if len(problems) > 1 else ""
        raise ConfigError(f"{path}: the checkpoint's {what} does not fit this run's ({first}{more})") from None


def find(resume: str) -> Path:
    p = Path(resume).expanduser()
    if p.is_dir():
        p = p / "checkpoints" / "last.pt"
    if not p.exists():
        raise ConfigError(f"train.resume={resume}: no checkpoint at {p}")
    return p


def _reason(e: Exception) -> str:
    """The specific cause from a ``torch.load`` error: its first sentence, and for weights-only
    unpickling failures the reason torch gives after its advice to load with ``weights_only=False``."""
    text = str(e)
    if "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:", 1)[1].split("Check the documentation", 1)[0]
    text = " ".join(text.split())
    return text.split(". ", 1)[0][:160] or "no detail"  # the first sentence; the rest is advice


_ELSEWHERE = "resume from another checkpoint or start afresh"


def verify(path: str | Path) -> None:
    """Refuse a checkpoint file whose bytes do not match its checksum, in one line, before it is
    parsed (a file without a checksum, from before checksums, is accepted; see ``tgdist.checksum``)."""
    try:
        checksum.verify(path)
    except checksum.Corrupt as e:
        raise ConfigError(f"{e}; {_ELSEWHERE}") from None
    except OSError as e:
        raise ConfigError(f"{path}: not a readable tgdist checkpoint ({e.strerror or e})") from None


def read(path: str | Path, map_location=None, mmap: bool = False) -> dict:
    """A checkpoint's ``last.pt`` (``weights_only``: model, optimizer, iteration, metrics lines;
    the memory and every rank's state are in the parts beside it), refused in one line when it is
    corrupt, unreadable, not tgdist's or of an earlier format."""
    verify(path)
    try:
        state = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as e:  # a foreign file, or one from before checksums that is cut short
        if mmap:  # mmap's own complaint (not a zip file) would hide what is wrong with it
            return read(path, map_location)
        raise ConfigError(f"{path}: not a readable tgdist checkpoint ({type(e).__name__}: {_reason(e)})") from None
    if not isinstance(state, dict) or "model" not in state:
        raise ConfigError(f"{path}: not a tgdist checkpoint (no model state)")
    if state.get("format") != FORMAT or "parts" not in state:
        raise ConfigError(f"{path}: a checkpoint of an earlier tgdist (format {state.get('format', 1)}, before one "
                          f"format for every layout); resume it with the tgdist that wrote it, or start afresh")
    return state


def trainer_state(trainer) -> dict:
    """What a rank's file keeps of its trainer besides the model, optimizer and memory: the CPU's
    random state, on a GPU the device generator's too (dropout there draws from it, not from the
    CPU's), and the trainer's embedding cache, so a resumed run draws and serves as the
    uninterrupted one."""
    out = {"torch_rng": torch.get_rng_state()}
    if torch.device(trainer.device).type == "cuda":
        out["cuda_rng"] = torch.cuda.get_rng_state(trainer.device)
    if trainer.cache is not None:
        out["embedding_cache"] = trainer.cache.state_dict()
    return out


def restore_trainer_state(path: Path, trainer, mine: dict) -> None:
    """``trainer_state`` back from a rank's file ``mine`` of the checkpoint ``path``; what an
    older checkpoint or a CPU run's lacks is said, with what it changes."""
    torch.set_rng_state(mine["torch_rng"])
    if torch.device(trainer.device).type == "cuda":
        if "cuda_rng" in mine:
            torch.cuda.set_rng_state(mine["cuda_rng"], trainer.device)
        else:
            log.warning("%s was saved by a run on the CPU: the GPU's dropout draws differ from an uninterrupted "
                        "run's from here on", path)
    if trainer.cache is not None:
        if "embedding_cache" in mine:
            trainer.cache.load_state_dict(mine["embedding_cache"])
        else:  # a checkpoint written before caches were checkpointed: the cache starts empty
            log.warning("%s holds no embedding cache (written by an older tgdist): the cache starts empty, so "
                        "this run's results differ from an uninterrupted run's (test AP was seen 0.4-1 point "
                        "apart)", path)


def parts(path: Path, state: dict) -> list[Path]:
    """The files a checkpoint ``last.pt`` (``path``, ``state``) holds beside it, in its iteration
    directory: every rank's RNG, read slots and losses, and the memory (per group, or per shard)."""
    d = path.parent / state["dir"]
    return [d / name for name in state["parts"]]


def verify_part(path: Path) -> None:
    """One line when a file of a parallel checkpoint is missing or corrupt."""
    if not path.is_file():
        raise ConfigError(f"{path}: missing, so the parallel checkpoint beside it is incomplete; {_ELSEWHERE}")
    verify(path)


def read_part(path: Path) -> dict:
    """A file of a parallel checkpoint (see ``parts``), checked, on the CPU."""
    verify_part(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ConfigError(f"{path}: not a readable tgdist checkpoint ({type(e).__name__}: {_reason(e)})") from None


def check_layout(path, state: dict, cfg: DictConfig) -> None:
    """A run resumes with the layout it was written under, or with another where its node memory
    can be re-placed (``tgdist.runtime.reshard``): one memory group without epoch parallelism on
    both sides (j = k = 1), where the trainer count i may change; anything else is refused in one
    line saying why. A parallel run resumes with the ``train.epochs`` it started with; one
    process, 1 x 1 x 1, may raise it to train on: its schedule does not depend on it."""
    p = cfg.parallel
    layout = f"{p.i} x {p.j} x {p.k}"  # as str(Layout) writes it
    written = state.get("layout", layout)
    if written != layout:
        old = [int(x) for x in written.split(" x ")]
        why = None
        if old[2] > 1 or p.k > 1:
            why = ("with parallel.k > 1 each memory group holds its own memory at its own place in the stream, "
                   "so no one memory is the run's")
        elif old[1] > 1 or p.j > 1:
            why = ("with parallel.j > 1 the subgroups train other places in the stream in one iteration, and only "
                   "the first writes memory")
        elif state.get("memory_backend") is None:
            why = "the checkpoint, of an older tgdist, does not say which store wrote its memory files"
        if why is not None:
            raise ConfigError(f"{path}: written by a run of layout {written}, and this run's is {layout} "
                              f"(parallel.i/j/k), a layout the memory cannot be re-placed to ({why}); resume with "
                              f"layout {written}, or change only parallel.i where j = k = 1")
    if layout != "1 x 1 x 1" and state.get("epochs", cfg.train.epochs) != cfg.train.epochs:
        raise ConfigError(f"{path}: this parallel run was started with train.epochs={state['epochs']}, and "
                          f"resumes only with it (train.epochs={cfg.train.epochs} changes every rank's schedule)")


def check_store(path, state: dict, cfg: DictConfig, backend: str | None = None) -> None:
    """The node memory resumes into any store: one that reads the files as they were written
    (stores keeping a whole copy per memory group read each other's; a partitioned store its own
    shards) loads its part of them, and another has the memory gathered and re-placed
    (``tgdist.runtime.reshard``), which needs the store that wrote them to read them. A
    checkpoint of an older tgdist names no store (``memory_backend``): its files are checked when
    they are read. ``backend``: the run's store as its validation resolved it
    (``build.Resolved.backend``; any store may resume, so it is not needed here)."""
    from tgdist import memory

    written = state.get("memory_backend")
    if written is not None and written not in memory.names():
        raise ConfigError(f"{path}: its node memory was written by memory.backend={written}, a store this tgdist "
                          f"does not have; resume where that store is registered (TGDIST_PLUGINS)")


def _plain(text: str | None) -> str:
    """A ``settings`` value (its ``repr``) as the command line writes it."""
    return "null" if text in (None, "None") else text.strip("'")


def check_resume(cfg: DictConfig, backend: str | None = None) -> tuple[Path, dict]:
    """What resuming from ``train.resume`` checks, without building anything (the data is
    checked by ``check_data`` once it is read): ``tgdist launch`` runs it before starting any
    process, so a mismatch is one line, not one per rank. Every file is checked against its
    checksum, the parts beside ``last.pt`` too. Returns the path and the state. ``backend``: the
    memory store the run's validation resolved (``check_store``)."""
    path = find(cfg.train.resume)
    state = read(path, map_location="cpu", mmap=True)
    if state.get("kind") == "best":
        raise ConfigError(f"{path}: the best validated epoch's model and memory, to use (checkpoint.load), not to "
                          f"resume from; resume with the run directory or its checkpoints/last.pt")
    check_layout(path, state, cfg)
    check_store(path, state, cfg, backend)
    check_config(path, state.get("config", {}), cfg, content_checked="data" in state, layout_checked=True)
    for part in parts(path, state):
        verify_part(part)
    return path, state


def load(path: str | Path, trainer, cfg: DictConfig) -> tuple[int, list]:
    """Restore a trained model into ``trainer`` (built from ``cfg``, in one process) from the
    checkpoint ``path``: the model, the optimizer and memory group 0's node memory, which a run
    leaves at the end of the training stream (or, after its evaluations, of the stream it
    evaluated). Returns the checkpoint's iteration and its metrics lines. A run resumes with
    ``train.resume``, not this."""
    path = Path(path)
    state = read(path, map_location="cpu")
    check_config(path, state.get("config", {}), cfg, content_checked="data" in state)
    check_data(path, state, trainer.g)
    restore(path, trainer.model, state["model"], "model")
    restore(path, trainer.optimizer, state["optimizer"], "optimizer state")
    memory = [name for name in state["parts"] if name.startswith("memory-0")]
    if len(memory) != 1:  # a memory sharded over trainers (one file per shard)
        raise ConfigError(f"{path}: its node memory is in {len(memory)} shards ({', '.join(memory)}); load it "
                          f"with the run's layout (train.resume)")
    part = path.parent / state["dir"] / memory[0]
    restore(part, trainer.memory, read_part(part), "node memory")
    return int(state["iteration"]), [dict(h) for h in state["history"]]


# ------------------------------------------------------------------------------------------------
# Writing in the background


class Staging:
    """Host buffers that receive the state at each save (``host_copy``), kept from one save to the
    next: a fresh allocation of a large memory costs its page faults each time (seen 10-20x the
    copy itself), a kept buffer only the copy. A save refills them only after the writer is done
    with the last one (``Writer.wait``). On a GPU they are pinned, and the copies asynchronous."""

    def __init__(self):
        self._buffers: dict[tuple, torch.Tensor] = {}

    def buffer(self, key: tuple, like: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(key)
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
            buf = torch.empty(like.shape, dtype=like.dtype, pin_memory=like.is_cuda)
            self._buffers[key] = buf
        return buf

    def reserve(self, state, key: tuple = ()) -> None:
        """Allocate and touch the buffers ``host_copy(state, self, key)`` will fill (their page
        faults paid here, in the writer thread, not by the first save). Reads shapes only."""
        if isinstance(state, torch.Tensor):
            _touch(self.buffer(key, state))
        elif isinstance(state, dict):
            for k, v in state.items():
                self.reserve(v, (*key, k))
        elif isinstance(state, (list, tuple)):
            for i, v in enumerate(state):
                self.reserve(v, (*key, i))

    def release(self) -> None:
        self._buffers.clear()

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


def _touch(buf: torch.Tensor) -> None:
    """Write every page of ``buf`` (zeros) with one thread and no torch op. It runs in the writer
    thread, beside training: a torch op there (``zero_``) started a second OpenMP team in the
    process, and from then on the training's own team ran slower for the whole run (TGN on
    Wikipedia, 2 threads on 2 cores: 0.78x the events/s, 4 pairs; its threads woke twice as often;
    benchmarks/results/restructuring_speed.md). NumPy's fill starts no team."""
    if buf.numel():
        buf.reshape(-1).view(torch.uint8).numpy().fill(0)


def host_copy(obj, staging: Staging | None = None, key: tuple = ()):
    """``obj`` (nested dicts, lists and tuples of tensors and plain values, as ``state_dict`` gives)
    with every tensor copied to host memory, into ``staging``'s buffers when given: the copy the
    background writer writes while training mutates the originals. Containers are rebuilt (a
    module state_dict's ``_metadata`` too), plain values kept (they are immutable); a NumPy array
    is copied. Tensors on a GPU are copied
    asynchronously on its current stream: ``ready_event`` makes the writer wait for them."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        if staging is None:
            return t.to("cpu", copy=True)
        buf = staging.buffer(key, t)
        buf.copy_(t, non_blocking=t.is_cuda)
        return buf
    if isinstance(obj, dict):
        out = (OrderedDict if isinstance(obj, OrderedDict) else dict)(
            (k, host_copy(v, staging, (*key, k))) for k, v in obj.items())
        if hasattr(obj, "_metadata"):  # a module's state_dict: the versions load_state_dict reads
            out._metadata = copy.deepcopy(obj._metadata)
        return out
    if isinstance(obj, (list, tuple)):
        items = [host_copy(v, staging, (*key, i)) for i, v in enumerate(obj)]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if hasattr(obj, "copy") and type(obj).__module__ == "numpy":
        return obj.copy()
    return obj


def ready_event():
    """A CUDA event after the copies ``host_copy`` queued on the current stream (None on the CPU):
    the writer synchronises on it before it reads the host buffers."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    event = torch.cuda.Event()
    event.record()
    return event


# Tests only: ``TGDIST_TEST_CHECKPOINT_PAUSE=ITERATION:SECONDS[:RANK]`` makes the writer of that
# checkpoint (on that rank, or on every rank) sleep before each file it writes, so that a test can
# kill the process mid-write.
_PAUSE = "TGDIST_TEST_CHECKPOINT_PAUSE"


def pause_for_tests(iteration: int, rank: int) -> float:
    spec = os.environ.get(_PAUSE)
    if not spec:
        return 0.0
    it, seconds, *who = spec.split(":")
    return float(seconds) if int(it) == iteration and (not who or int(who[0]) == rank) else 0.0


class Writer:
    """One thread that runs the checkpoint writes submitted to it, in order, while the caller
    trains on. ``wait`` returns once every submitted job is done and raises the first error one of
    them met (later jobs of a failed batch are skipped: a ``last.pt`` must not name a part whose
    write failed); ``close`` waits too, or with ``abandon`` tells the jobs that wait for other
    ranks (``commit``) to give up. Jobs take one argument, the ``threading.Event`` that says so."""

    def __init__(self):
        self._jobs: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.abandoned = threading.Event()
        self.busy_seconds = 0.0  # the time spent writing (benchmarks: the write the training does not wait for)

    def submit(self, job: Callable[[threading.Event], None], ready=None) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="tgdist-checkpoint-writer", daemon=True)
            self._thread.start()
        self._jobs.put((job, ready))

    def _serve(self) -> None:
        while True:
            job, ready = self._jobs.get()
            try:
                if job is None:
                    return
                if self._error is None:
                    start = time.perf_counter()
                    if ready is not None:
                        ready.synchronize()
                    job(self.abandoned)
                    self.busy_seconds += time.perf_counter() - start
            except BaseException as e:  # raised to the training thread by wait()
                self._error = e
            finally:
                self._jobs.task_done()

    def pending(self) -> bool:
        return self._jobs.unfinished_tasks > 0

    def wait(self) -> None:
        """Block until every job submitted is done; raise the first error among them."""
        if self._thread is not None:
            self._jobs.join()
        error, self._error = self._error, None
        if error is not None:
            raise error

    def close(self, abandon: bool = False) -> None:
        """Wait for the jobs (``abandon``: a commit waiting for other ranks gives up) and stop the
        thread. An error is raised as by ``wait``, unless abandoned (the run fails already)."""
        if abandon:
            self.abandoned.set()
        try:
            if abandon:
                try:
                    self.wait()
                except Exception as e:
                    log.warning("a checkpoint write of this failed run did not finish: %s", e)
            else:
                self.wait()
        finally:
            if self._thread is not None:
                self._jobs.put((None, None))
                self._thread.join()
                self._thread = None


def report_failure(directory: Path, rank: int, error: BaseException) -> None:
    """Leave word in a checkpoint's directory that this rank's parts failed (best effort), so rank 0
    stops waiting for them and does not commit the checkpoint."""
    info = {"type": type(error).__name__, "message": " ".join(str(error).split())[:300],
            "errno": getattr(error, "errno", None), "strerror": getattr(error, "strerror", None),
            "filename": str(getattr(error, "filename", "") or "") or None}
    try:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / f".rank-{rank}.failed").write_text(json.dumps(info))
    except OSError:
        pass


# How long rank 0 waits for the other ranks' parts once its own are written: the bound of the
# training collectives (a rank that slow has failed the run already).
PARTS_TIMEOUT = 600.0


def await_parts(directory: Path, names: list[str], abandoned: threading.Event,
                timeout: float = PARTS_TIMEOUT) -> bool:
    """Wait until every file ``names`` in ``directory`` exists (an ``atomic_save`` file exists only
    complete and sealed). False when ``abandoned``; a rank's failure report, or the timeout, raises."""
    deadline = time.monotonic() + timeout
    pause = 0.005
    while True:
        missing = [n for n in names if not (directory / n).exists()]
        if not missing:
            return True
        for report in sorted(directory.glob(".rank-*.failed")):
            info = json.loads(report.read_text() or "{}")
            rank = report.name.split("-")[1].split(".")[0]
            if info.get("errno") is not None:
                raise OSError(info["errno"], f"rank {rank}: {info.get('strerror') or info.get('message')}",
                              info.get("filename"))
            raise RuntimeError(f"rank {rank} could not write its part of checkpoint {directory}: "
                               f"{info.get('type')}: {info.get('message')}")
        if abandoned.is_set():
            return False
        if time.monotonic() > deadline:
            raise RuntimeError(f"{directory}: {', '.join(missing)} not written after {timeout:.0f} s; the checkpoint "
                               f"is not committed (last.pt names the previous one)")
        time.sleep(pause)
        pause = min(pause * 2, 0.1)
