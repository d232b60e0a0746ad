"""What the ranks of a parallel run need besides the loop (``tgdist.runtime.run.Run``): log lines
prefixed with the rank, the settings every rank must share, this rank's share of the machine's CPUs, a digest of the model replica, and the fault
injection of the tests."""

from __future__ import annotations

import hashlib
import logging
import os
import socket

import torch
from omegaconf import DictConfig

from tgdist.distributed import collectives
from tgdist.kernels.graph import cpu_mask
from tgdist.runtime import checkpoint

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


def fault_injection(rank: int) -> int | None:
    """``TGDIST_FAULT_KILL=RANK:ITERATION`` (tests only): that rank SIGKILLs itself there, on the
    run's first start only (a restart by torchrun or SLURM, which resumes, goes past it)."""
    spec = os.environ.get("TGDIST_FAULT_KILL")
    if not spec or any(os.environ.get(v, "0") not in ("", "0") for v in ("TORCHELASTIC_RESTART_COUNT",
                                                                          "SLURM_RESTART_COUNT")):
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
             "sampler.num_threads", "train.device", "train.progress", "train.tensorboard", "memory.num_threads"}


def shared_settings(cfg: DictConfig) -> dict:
    """The settings every rank of a parallel run must share (as strings): all of the config but
    ``_PER_RANK``. Ranks started by hand on several machines can be given other overrides."""
    return checkpoint.settings(cfg, ("data", "sampler", "model", "train", "parallel", "memory"), _PER_RANK)
